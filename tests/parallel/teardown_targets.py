"""Rank bodies of the teardown tests (module-level so the spawn harness can pickle them by name)."""

from __future__ import annotations

import atexit
import datetime
import gc
import os
import time
import weakref

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import splitgrad
from splitgrad.parallel import DistributedDataParallel
from splitgrad.parallel.tensor import tensor_parallel_groups
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


def _gloo_workers_settled(at_most: int) -> int:
    """The gloo worker count once it is ``<= at_most``, or after 1 s: a joined worker's kernel task leaves
    ``/proc`` a moment after the join, while a held group's workers stay (the count is load-independent)."""
    for _ in range(20):
        alive = _gloo_workers()
        if alive <= at_most:
            return alive
        time.sleep(0.05)
    return _gloo_workers()


def _tp_model_step(rank: int, world_size: int, tp_group: dist.ProcessGroup) -> tuple[nn.Module, float]:
    """A column -> row tensor-parallel pair with deferred wgrad on ``tp_group``: one float64 step, checked
    against plain autograd on the full weights. Returns the model and the largest relative difference."""
    gen = torch.Generator().manual_seed(5)
    w1, w2 = torch.randn(4 * D, D, dtype=F64, generator=gen), torch.randn(D, 4 * D, dtype=F64, generator=gen)
    x = torch.randn(BATCH, D, dtype=F64, generator=gen)
    tp = {"tp_group": tp_group, "bias": False, "delay_wgrad_compute": True, "params_dtype": F64}
    model = nn.Sequential(
        splitgrad.Linear(D, 4 * D, parallel_mode="column", **tp),
        splitgrad.Linear(4 * D, D, parallel_mode="row", **tp),
    )
    with torch.no_grad():
        model[0].weight.copy_(shard(w1, rank, world_size, 0))
        model[1].weight.copy_(shard(w2, rank, world_size, 1))
    xs = x.clone().requires_grad_()
    y = model(xs)
    y.square().sum().backward()
    splitgrad.backward_dw(model)
    ref = [w1.clone().requires_grad_(), w2.clone().requires_grad_(), x.clone().requires_grad_()]
    y_ref = ref[2] @ ref[0].T @ ref[1].T
    y_ref.square().sum().backward()
    got = [model[0].weight.grad, model[1].weight.grad, xs.grad, y]
    want = [
        shard(ref[0].grad, rank, world_size, 0),
        shard(ref[1].grad, rank, world_size, 1),
        ref[2].grad,
        y_ref,
    ]
    return model, max(((g - w).abs().max() / w.abs().max()).item() for g, w in zip(got, want, strict=True))


def gloo_workers_at_exit(rank: int, world_size: int, out_dir: str) -> dict[str, float]:
    """Import what the first ``torch.optim`` optimizer imports (``torch.distributed._shard``, via
    ``torch._dynamo``) after the group exists, run a collective and a tensor-parallel step on a group of its
    own (``tensor_parallel_groups``), keep the TP model, its layout and a live autograd graph in :data:`HELD`,
    and record at interpreter exit (after the harness's ``destroy_process_group()``) how many gloo worker
    threads are left. Returns the counts seen on the way, and the negative check: a group destroyed while a
    strong holder keeps it leaves its workers running until the holder lets go."""
    import importlib

    importlib.import_module("torch.distributed._shard")
    x = torch.full((4,), float(rank + 1))
    dist.all_reduce(x)
    if not torch.equal(x, torch.full((4,), float(world_size * (world_size + 1) // 2))):
        raise RuntimeError(f"all_reduce gave {x.tolist()}")
    out = {"default group": _gloo_workers()}

    groups = tensor_parallel_groups(world_size)
    model, out["tp max rel error"] = _tp_model_step(rank, world_size, groups.tp_group)
    graph = model(torch.ones(BATCH, D, dtype=F64, requires_grad=True))  # its autograd nodes keep the configs
    HELD.extend([model, groups, graph])
    out["with tp groups"] = _gloo_workers()

    probe = dist.new_group(list(range(world_size)))
    dist.all_reduce(torch.ones(1), group=probe)
    out["with probe"] = _gloo_workers()
    strong, ref = [probe], weakref.ref(probe)
    del probe
    dist.destroy_process_group(ref())
    gc.collect()
    out["probe destroyed, held"] = _gloo_workers()
    del strong
    gc.collect()
    out["probe destroyed, dropped"] = _gloo_workers_settled(at_most=int(out["with tp groups"]))

    atexit.register(_write_gloo_workers, os.path.join(out_dir, f"rank{rank}.txt"))
    return out
