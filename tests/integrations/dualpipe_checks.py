"""Checks run inside spawned gloo ranks: DeepSeek's DualPipe (the real ``dualpipe`` package) with splitgrad layers,
and torch's ``ScheduleDualPipeV`` with splitgrad adapter stages.

DualPipe targets CUDA; two of its calls are patched in these ranks, nothing else: the device assertion of
``DualPipe.__init__`` (``torch.cuda.current_device``) and ``dualpipe.comm.build_from_tensor_shapes`` (its
receive buffers are allocated with ``device="cuda"``). Its point-to-point messages run on gloo unchanged.

What DualPipe's own example checks is checked here the same way: the loss ``torch.equal`` to the sequential
reference (the same forward arithmetic), every gradient within ``cal_diff < 1e-13``; and more: every
gradient against plain float64 autograd, against splitgrad's runtime ``dualpipev`` on the same stages and
microbatches (gradients do not depend on the schedule), and splitgrad's account of owed work.
"""

from __future__ import annotations

import copy
import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import splitgrad
from splitgrad.integrations import dualpipe as bridge
from splitgrad.pipeline import build_runtime, pipeline_groups
from splitgrad.pipeline.torch_adapter import splitgrad_pipeline_stage
from splitgrad.testing import assert_grads_close, make_plain
from tests.helpers import expect_error, run_named

F64 = torch.float64
HIDDEN, ROWS = 8, 2  # a microbatch is (ROWS, HIDDEN)


def criterion(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output, target).clone()  # DualPipe's example criterion


def cal_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """DualPipe's example's gradient check (1 - cosine similarity, symmetrised)."""
    x, y = x.double(), y.double()
    return 1 - 2 * (x * y).sum().item() / (x * x + y * y).sum().item()


def full_stages(n: int, seed: int) -> list[nn.Module]:
    """``n`` stages of delayed splitgrad layers (Linear -> GELU -> Linear, with biases), float64."""
    torch.manual_seed(seed)
    kw = {"delay_wgrad_compute": True, "params_dtype": F64}
    return [
        nn.Sequential(
            splitgrad.Linear(HIDDEN, 2 * HIDDEN, **kw), nn.GELU(), splitgrad.Linear(2 * HIDDEN, HIDDEN, **kw)
        )
        for _ in range(n)
    ]


def data(n_microbatches: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (n_microbatches * ROWS, HIDDEN)
    return torch.randn(shape, dtype=F64, generator=g), torch.randn(shape, dtype=F64, generator=g)


def reference(stages: list[nn.Module], x: torch.Tensor, y: torch.Tensor, n_microbatches: int):
    """DualPipe's ``ref_step`` in plain float64 autograd: per-microbatch losses and summed gradients by stage."""
    model = make_plain(nn.Sequential(*copy.deepcopy(stages)))
    losses = []
    for xm, ym in zip(x.chunk(n_microbatches), y.chunk(n_microbatches), strict=True):
        loss = criterion(model(xm), ym)
        loss.backward()
        losses.append(loss.detach())
    grads = {s: [p.grad.clone() for p in stage.parameters()] for s, stage in enumerate(model)}
    return torch.stack(losses), grads


def gather_stage_grads(held: dict[int, nn.Module]) -> dict[int, list[torch.Tensor]]:
    """``{stage: [grads]}`` over all ranks, replicas of a stage summed (DualPipe holds each stage twice)."""
    mine = {s: [p.grad.clone() for p in m.parameters()] for s, m in held.items()}
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    total: dict[int, list[torch.Tensor]] = {}
    for part in everyone:
        for s, grads in part.items():
            total[s] = grads if s not in total else [a + b for a, b in zip(total[s], grads, strict=True)]
    return total


def named(grads: dict[int, list[torch.Tensor]], scale: float = 1.0) -> dict[str, torch.Tensor]:
    return {f"stage{s}.{i}": g * scale for s, gs in grads.items() for i, g in enumerate(gs)}


def patch_cuda() -> None:
    """DualPipe's two CUDA-only calls, and nothing else."""
    import dualpipe.comm as comm

    torch.cuda.current_device = lambda: "cpu"
    comm.build_from_tensor_shapes = lambda: [
        torch.empty(s, dtype=comm.TENSOR_DTYPE, requires_grad=True) for s in comm.TENSOR_SHAPES
    ]


def runtime_grads(
    stages: list[nn.Module], n_microbatches: int, x, y, pp_group
) -> dict[int, list[torch.Tensor]]:
    """splitgrad's runtime ``dualpipev`` over ``pp_group`` on copies of ``stages``: ``{stage: [grads]}`` of the
    stages it holds, gathered over the ranks of pipeline 0, times ``n_microbatches`` (its loss is the mean)."""
    mine = copy.deepcopy(stages)
    with build_runtime(
        mine, "dualpipev", n_microbatches=n_microbatches, loss_fn=criterion, pp_group=pp_group
    ) as rt:
        rt.step(x, y)
        held_ids = {id(p) for p in rt.parameters()}
    held = {s: m for s, m in enumerate(mine) if all(id(p) in held_ids for p in m.parameters())}
    for m in held.values():
        for p in m.parameters():
            p.grad.mul_(n_microbatches)
    return held


def check_dualpipe(rank: int, world: int) -> None:
    """DualPipe (bidirectional) on ``world`` ranks: stages ``rank`` and ``world - 1 - rank`` on each."""
    from dualpipe import DualPipe, WeightGradStore, set_p2p_tensor_dtype, set_p2p_tensor_shapes

    n_mb = 2 * world
    stages = full_stages(world, seed=0)
    x, y = data(n_mb, seed=1)
    loss_ref, grads_ref = reference(stages, x, y, n_mb)
    local = nn.Sequential(copy.deepcopy(stages[rank]), copy.deepcopy(stages[world - 1 - rank]))
    set_p2p_tensor_shapes([(ROWS, HIDDEN)])
    set_p2p_tensor_dtype(F64)
    handed, real_put = [], WeightGradStore.put
    WeightGradStore.put = classmethod(lambda cls, f: (handed.append(f), real_put.__func__(cls, f))[-1])
    try:
        with bridge.attach(local):
            model = DualPipe(local)
            first, last = rank == 0, rank == world - 1
            inputs = x.chunk(2)[0] if first else x.chunk(2)[1] if last else None
            labels = y.chunk(2)[1] if first else y.chunk(2)[0] if last else None
            loss, _ = model.step(inputs, num_chunks=n_mb, criterion=criterion, labels=(labels,))
    finally:
        WeightGradStore.put = real_put
    # the example's loss check, bitwise
    if first:
        assert torch.equal(loss, loss_ref.chunk(2)[1]), (loss, loss_ref)
    elif last:
        assert torch.equal(loss, loss_ref.chunk(2)[0]), (loss, loss_ref)
    else:
        assert loss is None
    # every W ran, exactly once: DualPipe's queue is empty, splitgrad owes nothing, and the zero-bubble
    # phases did hand work over (on every rank: each has steps with enable_zb=True)
    assert WeightGradStore.funcs_queue.empty()
    splitgrad.ensure_no_pending_wgrad(local, what="the end of the DualPipe step")
    assert handed, f"rank {rank}: DualPipe's store received no splitgrad W"
    got = gather_stage_grads({rank: local[0], world - 1 - rank: local[1]})
    for s, grads in got.items():
        for i, (g, ref) in enumerate(zip(grads, grads_ref[s], strict=True)):
            assert cal_diff(g, ref) < 1e-13, f"stage {s} parameter {i}: cal_diff {cal_diff(g, ref)}"
    assert_grads_close(named(got), named(grads_ref), rtol=1e-12, atol=1e-14, what=f"DualPipe rank {rank}")
    # the same stages and microbatches under splitgrad's runtime dualpipev (world / 2 ranks per pipeline)
    groups = pipeline_groups(pp_size=world // 2, dp_size=2)
    held = runtime_grads(stages, n_mb, x, y, groups.pp_group)
    from_runtime = gather_stage_grads(held if groups.dp_rank == 0 else {})
    assert_grads_close(named(got), named(from_runtime), rtol=1e-12, atol=1e-14, what="DualPipe vs dualpipev")


def check_torch_dualpipev(rank: int, world: int) -> None:
    """torch's ``ScheduleDualPipeV`` (DualPipeV's order, the closest real oracle: PyPI's dualpipe has no
    DualPipeV) with splitgrad adapter stages, against plain float64 autograd and splitgrad's runtime."""
    from torch.distributed.pipelining import ScheduleDualPipeV

    n_stages = 2 * world
    n_mb = n_stages
    stages = full_stages(n_stages, seed=2)
    x, y = data(n_mb, seed=3)
    loss_ref, grads_ref = reference(stages, x, y, n_mb)
    mine = {s: copy.deepcopy(stages[s]) for s in (rank, n_stages - 1 - rank)}
    pipeline = [splitgrad_pipeline_stage(m, s, n_stages, "cpu") for s, m in sorted(mine.items())]
    schedule = ScheduleDualPipeV(pipeline, n_mb, loss_fn=criterion)
    losses: list[torch.Tensor] = []
    if rank == 0:  # stage 0 and the last stage: inputs and targets
        schedule.step(x, target=y, losses=losses)
        assert torch.equal(torch.stack(losses), loss_ref), (losses, loss_ref)
    else:
        schedule.step()
    for stage in pipeline:
        splitgrad.ensure_no_pending_wgrad(stage.submod, what="the end of the ScheduleDualPipeV step")
    got = gather_stage_grads(mine)
    assert_grads_close(
        named(got), named(grads_ref, 1 / n_mb), rtol=1e-12, atol=1e-14, what="ScheduleDualPipeV"
    )
    held = runtime_grads(stages, n_mb, x, y, None)
    from_runtime = gather_stage_grads(held)
    assert_grads_close(
        named(got, n_mb), named(from_runtime), rtol=1e-12, atol=1e-14, what="torch vs dualpipev"
    )


def check_wrong_answer_is_rejected(rank: int, world: int) -> None:
    """Not trivially passing: the comparisons above refuse gradients one microbatch short."""
    n_mb = 2 * world
    stages = full_stages(world, seed=0)
    x, y = data(n_mb, seed=1)
    _, full = reference(stages, x, y, n_mb)
    _, short = reference(stages, x[:-ROWS], y[:-ROWS], n_mb - 1)
    bad = max(cal_diff(a, b) for s in full for a, b in zip(full[s], short[s], strict=True))
    assert bad > 1e-13, f"cal_diff did not see a missing microbatch ({bad})"
    expect_error(
        AssertionError,
        "short",
        lambda: assert_grads_close(named(short), named(full), rtol=1e-12, atol=1e-14, what="short"),
    )


ALL = ["dualpipe", "torch_dualpipev", "wrong_answer_is_rejected"]
_CHECKS = {"dualpipe": check_dualpipe, "torch_dualpipev": check_torch_dualpipev}
_CHECKS["wrong_answer_is_rejected"] = check_wrong_answer_is_rejected


def run_checks(rank: int, world: int, names: list[str]) -> dict[str, str | None]:
    """Entry point of every rank: patch DualPipe's CUDA calls, then run the named checks."""
    patch_cuda()
    return run_named({n: functools.partial(_CHECKS[n], rank, world) for n in names}, names)
