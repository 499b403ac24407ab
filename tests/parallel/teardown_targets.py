"""Rank bodies of the teardown tests (module-level so the spawn harness can pickle them by name)."""

from __future__ import annotations

import atexit
import datetime
import gc
import os
import weakref

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import splitgrad
from splitgrad.parallel import DistributedDataParallel
from splitgrad.pipeline import build_runtime
from splitgrad.testing import plain_autograd_grads, shard

#: Objects a rank keeps past ``destroy_process_group`` (the "hold" mode): a user's global wrapper, freed only
#: at interpreter exit, which is where the process group used to be destroyed, and gloo to abort.
HELD: list[object] = []

F64 = torch.float64
BATCH, D = 8, 6


def report_then_exit(rank: int, world_size: int, codes: dict[int, str]) -> int:
    """Report success, then die at interpreter exit: ``"abort"`` (SIGABRT, like gloo) or an exit code."""
    what = codes.get(rank)
    if what == "abort":
        atexit.register(os.abort)
    elif what is not None:
        atexit.register(os._exit, int(what))
    return rank


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    split = {"delay_wgrad_compute": True, "params_dtype": F64}
    return nn.Sequential(splitgrad.Linear(D, D, **split), nn.Tanh(), splitgrad.Linear(D, 3, **split))


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return torch.randn(BATCH, D, dtype=F64, generator=gen), torch.randn(BATCH, 3, dtype=F64, generator=gen)


def lifecycles(rank: int, world_size: int, store_dir: str, modes: list[str]) -> list[dict[str, object]]:
    """Per mode, a whole job's life: a fresh process group, a DDP step and a 2-rank pipeline step (float64,
    checked against plain autograd), teardown, ``destroy_process_group()``.

    ``mode``: ``"close"`` closes both explicitly, ``"drop"`` just lets them go (they must be freed at once,
    without the garbage collector: nothing may keep the process group alive), ``"hold"`` keeps them in
    :data:`HELD` past ``destroy_process_group`` until interpreter exit. Runs with ``backend=None``: the
    harness then only checks that the process exits 0.
    """
    results = []
    for i, mode in enumerate(modes):
        dist.init_process_group(
            "gloo",
            store=dist.FileStore(os.path.join(store_dir, f"store{i}"), world_size),
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=60),
        )
        # Without the cycle collector, "freed" means freed by reference counting, as at a function's end.
        gc.disable()
        try:
            results.append(_once(rank, world_size, mode))
        finally:
            gc.enable()
        dist.destroy_process_group()
    return results


def _once(rank: int, world_size: int, mode: str) -> dict[str, object]:
    x, y = _batch()
    out: dict[str, object] = {}

    # Data parallel: each rank its shard; main_grad must hold the full-batch float64 average.
    model = _model()
    ddp = DistributedDataParallel(model)
    F.mse_loss(ddp(shard(x, rank, world_size)), shard(y, rank, world_size)).backward()
    splitgrad.backward_dw(ddp)
    ddp.finish_grad_sync()
    expected = plain_autograd_grads(_model(), lambda m: F.mse_loss(m(x), y))
    out["ddp_max_err"] = max(
        (p.main_grad - expected[n]).abs().max().item() for n, p in model.named_parameters()
    )

    # Pipeline: stage ``rank`` of the same model cut in two; the broadcast loss is the full-batch loss.
    pipe = _model()
    runtime = build_runtime([pipe[:2], pipe[2:]], "zb-h1", loss_fn=F.mse_loss, n_microbatches=2, timeout=60)
    result = runtime.step(x, y)
    out["runtime_loss_err"] = abs(result.loss.item() - F.mse_loss(_model()(x), y).item())
    stage = pipe[:2] if rank == 0 else pipe[2:]  # slices keep the parent's names ("2.weight")
    out["runtime_max_err"] = max(
        (p.grad - expected[n]).abs().max().item() for n, p in stage.named_parameters()
    )

    refs = {"ddp": weakref.ref(ddp), "runtime": weakref.ref(runtime)}
    if mode == "close":
        ddp.close()
        runtime.close()
        out["closed"] = {
            "ddp.closed": ddp.closed,
            "main_grad left": any(hasattr(p, "main_grad") for p in model.parameters()),
            "group held": ddp.process_group is not None or runtime.comm is not None,
            "forward after close": _error_of(ddp, x),
            "step after close": _error_of(runtime.step, x, y),
        }
        # The same parameters can be wrapped again; the closed wrapper dying later must not touch them.
        model.zero_grad(set_to_none=True)
        again = DistributedDataParallel(model, broadcast_at_init=False)
    if mode == "hold":
        HELD.extend([ddp, runtime])
    del ddp, runtime, result
    out["alive after drop"] = sorted(k for k, r in refs.items() if r() is not None and mode != "hold")
    if mode == "close":
        out["rewrapped main_grad kept"] = all(hasattr(p, "main_grad") for p in model.parameters())
        again.close()
    if mode == "drop":  # a dropped wrapper detaches itself, like remove_hooks()
        out["attrs left after drop"] = [n for n, p in model.named_parameters() if hasattr(p, "main_grad")]
    return out


def _error_of(fn, *args) -> str | None:
    try:
        fn(*args)
    except RuntimeError as exc:
        return str(exc)
    return None


def _gloo_workers() -> int:
    """Threads of this process that are gloo process-group workers (torch names them ``pt_gloo_runloop``)."""
    tasks = "/proc/self/task"
    return sum(open(f"{tasks}/{t}/comm").read().strip() == "pt_gloo_runloop" for t in os.listdir(tasks))


def _write_gloo_workers(path: str) -> None:
    with open(path, "w") as f:
        f.write(str(_gloo_workers()))


def gloo_workers_at_exit(rank: int, world_size: int, out_dir: str) -> int:
    """Import what the first ``torch.optim`` optimizer imports (``torch.distributed._shard``, via
    ``torch._dynamo``) after the group exists, run a collective, and record at interpreter exit (after the
    harness's ``destroy_process_group()``) how many gloo worker threads are left. Returns the count now."""
    import importlib

    importlib.import_module("torch.distributed._shard")
    x = torch.full((4,), float(rank + 1))
    dist.all_reduce(x)
    if not torch.equal(x, torch.full((4,), float(world_size * (world_size + 1) // 2))):
        raise RuntimeError(f"all_reduce gave {x.tolist()}")
    atexit.register(_write_gloo_workers, os.path.join(out_dir, f"rank{rank}.txt"))
    return _gloo_workers()
