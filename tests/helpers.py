"""Gradient snapshots and ``main_grad`` buffers shared by every test folder (one definition of each).

Why here: four folders had their own ``grads()`` and three their own ``attach_main_grad`` with subtly
different rules (which parameters get a buffer, which dtype, whether ``.grad`` or ``main_grad`` wins). A
test comparing gradients must read them the way the library writes them, so there is one rule:

* a parameter that has a ``main_grad`` buffer keeps its gradient there (fused accumulation writes it there,
  ``.grad`` stays None); any other parameter keeps it in ``.grad``;
* the parameters that get a buffer are the matrices a split-capable module writes itself — the 2-D entries
  of ``get_backward_dw_params()`` over the split-capable submodules — as a data-parallel wrapper attaches them.
"""

from __future__ import annotations

import os
import subprocess
import sys
import traceback
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import splitgrad

__all__ = [
    "attach_main_grad",
    "destroyed_group",
    "expect_error",
    "fused_weights",
    "grads",
    "make_graphed",
    "one_rank_group",
    "rank_failures",
    "run_named",
    "run_torchrun",
]

#: This checkout's ``src``: what a subprocess must import as ``splitgrad``.
SRC = Path(splitgrad.__file__).resolve().parents[1]


def grads(module: nn.Module) -> dict[str, torch.Tensor | None]:
    """Every parameter's gradient, by name, cloned (None stays None).

    Returns:
        ``{name: main_grad}`` for parameters carrying a ``main_grad`` buffer, ``{name: .grad}`` for the rest.

    Raises:
        AssertionError: a parameter holds both a ``main_grad`` and a ``.grad`` — its gradient went to two places
            (counted twice, or written where nobody reads it).
    """
    out: dict[str, torch.Tensor | None] = {}
    for name, p in module.named_parameters():
        main = getattr(p, "main_grad", None)
        if main is not None and p.grad is not None:
            raise AssertionError(f"{name}: has both main_grad and .grad (shape {tuple(p.shape)})")
        g = main if main is not None else p.grad
        out[name] = None if g is None else g.detach().clone()
    return out


def fused_weights(module: nn.Module) -> list[nn.Parameter]:
    """The parameters that need ``main_grad`` when fused: the weight matrices among the
    ``get_backward_dw_params()`` of every split-capable submodule of ``module`` (``module`` included) — 2-D
    weights and 3-D grouped weights ``(groups, out, in)``, not biases (a grouped bias ``(groups, out)`` is 2-D
    too, hence the name test) — frozen ones left out, each once."""
    seen: dict[int, nn.Parameter] = {}
    for _, m in splitgrad.split_modules(module):
        names = {id(p): n.rsplit(".", 1)[-1] for n, p in m.named_parameters()}
        for p in m.get_backward_dw_params():
            if p.dim() >= 2 and "bias" not in names.get(id(p), ""):
                seen.setdefault(id(p), p)
    return list(seen.values())


def attach_main_grad(
    module: nn.Module,
    *,
    fill: float | None = None,
    dtype: torch.dtype | None = None,
    seed: int = 0,
) -> list[nn.Parameter]:
    """Give every :func:`fused_weights` parameter a ``main_grad`` buffer, as a data-parallel wrapper does.

    Args:
        module: the module (or model) whose split-capable submodules fuse into ``main_grad``.
        fill: the buffer's constant value; None draws it at random (seeded), as a buffer mid-accumulation.
        dtype: the buffer's dtype (default: each parameter's own; ``torch.float32`` for Megatron's fp32
            buffers under bf16 parameters).
        seed: seeds the random contents.

    Returns:
        The parameters that got a buffer (each buffer shaped as its weight).
    """
    gen = torch.Generator().manual_seed(seed)
    params = fused_weights(module)
    for p in params:
        buf_dtype = p.dtype if dtype is None else dtype
        if fill is None:
            p.main_grad = torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p.device, buf_dtype)
        else:
            p.main_grad = torch.full(p.shape, fill, dtype=buf_dtype, device=p.device)
    return params


def make_graphed(callables, sample_args, **kwargs):
    """``splitgrad.make_graphed_callables`` on the CPU graph emulator unless ``backend`` is given.

    CI has no GPU and ``backend="auto"`` refuses CPU tensors (the emulator is slower than eager), so every
    capture-logic test opts in to the test double here, in one place.
    """
    from splitgrad.testing import CpuGraphBackend

    kwargs.setdefault("backend", CpuGraphBackend())
    return splitgrad.make_graphed_callables(callables, sample_args, **kwargs)


def one_rank_group(tmp_path_factory):
    """Generator for a module-scoped fixture: a one-rank gloo default group in this process (FileStore, no
    spawn), torn down afterwards; skips when the process already has a default group."""
    import datetime

    import pytest
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a default process group already exists in this process")
    store = dist.FileStore(str(tmp_path_factory.mktemp("pg") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=60))
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def destroyed_group(make_holders):
    """Build holders on a fresh one-rank group of the default group (:func:`one_rank_group`), destroy the group,
    collect garbage; return ``(weakref to the group, holders)``: the reference is dead unless a holder kept it."""
    import gc
    import weakref

    import torch.distributed as dist

    own = dist.new_group([0])
    holders = make_holders(own)
    ref = weakref.ref(own)
    del own
    dist.destroy_process_group(ref())
    gc.collect()
    return ref, holders


def expect_error(exc_type: type[BaseException], text: str, fn) -> None:
    """Call ``fn()``; raise ``AssertionError`` unless it raises ``exc_type`` with ``text`` in its message.

    For checks that run inside spawned ranks, where ``pytest.raises`` cannot be used (its failure is a
    ``BaseException`` the ranks' check runners do not report).
    """
    try:
        fn()
    except exc_type as exc:
        if text not in str(exc):
            raise AssertionError(f"expected {exc_type.__name__} mentioning {text!r}, got: {exc}") from exc
    else:
        raise AssertionError(f"expected {exc_type.__name__} mentioning {text!r}; nothing was raised")


def run_named(table: dict[str, Callable[[], None]], names: list[str]) -> dict[str, str | None]:
    """Inside spawned ranks: ``{name: None (passed) | traceback}`` for ``table[name]()`` of each name, in order.

    One spawn runs many checks (start-up and imports paid once), each reported as its own pytest test through
    :func:`rank_failures`. Ranks agree after every check whether to go on, so one rank's failure cannot leave
    another waiting in a collective its peer never reaches; the checks after a failure are reported as not run.
    """
    results: dict[str, str | None] = {}
    failed: str | None = None
    for name in names:
        if failed is not None:
            results[name] = f"not run: {failed} failed first"
            continue
        try:
            table[name]()
            results[name] = None
        except Exception:
            results[name] = traceback.format_exc()
        flag = torch.tensor([results[name] is not None], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item():
            failed = name
    return results


def rank_failures(results: list[dict[str, str | None]], name: str) -> str:
    """The failures of check ``name`` over all ranks' :func:`run_named` results (empty when it passed)."""
    return "\n".join(
        f"--- rank {r} ---\n{res[name]}" for r, res in enumerate(results) if res[name] is not None
    )


def run_torchrun(
    script_and_args: Sequence[str],
    *,
    ranks: int,
    cwd: Path,
    torchrun_args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    timeout: float = 600,
) -> subprocess.CompletedProcess[str]:
    """``torchrun --standalone --nproc-per-node=<ranks> [torchrun_args] <script> [args]`` in ``cwd``.

    Each rank imports this checkout's ``splitgrad`` (``src`` on ``PYTHONPATH``) and runs one OpenMP thread (the
    ranks share the cores); ``env`` adds to that environment or overrides it. Output is captured as text. A
    non-zero exit is returned, not raised: the caller says what failed.
    """
    full_env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1", **(env or {})}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
    return subprocess.run(
        [*command, *torchrun_args, *script_and_args],
        cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout, check=False,
    )  # fmt: skip
