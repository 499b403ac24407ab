"""Checks run inside spawned gloo ranks for the torch.distributed.pipelining adapter (not a test module).

Every check builds fresh float64 models, runs PyTorch's own schedules on them and raises on a wrong result.
:func:`run_checks` runs a list of them in one process group and returns ``{check: None | traceback}``, so
each is reported as its own pytest test while process start-up is paid once. Ranks agree after every check
whether to go on, so one rank's failure cannot leave the other waiting for a peer that moved on.

Checks whose point is that something *fails* (PyTorch's native split on 3-D activations, sabotaged W
bookkeeping) run a one-rank pipeline of two stages in a per-rank group: a failure mid-step then cannot
strand a peer in a receive.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)

import splitgrad
from splitgrad.pipeline.torch_adapter import SplitgradPipelineStage, splitgrad_pipeline_stage
from splitgrad.testing import assert_grads_close
from tests.helpers import expect_error

F64 = torch.float64
HIDDEN, FFN = 8, 16
N_BLOCKS = 4
N_MICROBATCHES = 4
SCHEDULES = {
    "1f1b": Schedule1F1B,
    "interleaved_zb": ScheduleInterleavedZeroBubble,
    "zbv": ScheduleZBVZeroBubble,
}


# -- model, data, reference ---------------------------------------------------------------------------------
class MLPBlock(nn.Module):
    """``fc2(gelu(fc1(x)))`` without a residual: on 3-D input its output is a view (``F.linear`` folds)."""

    def __init__(self, split: bool) -> None:
        super().__init__()
        if split:
            self.fc1 = splitgrad.Linear(HIDDEN, FFN, delay_wgrad_compute=True, params_dtype=F64)
            self.fc2 = splitgrad.Linear(FFN, HIDDEN, delay_wgrad_compute=True, params_dtype=F64)
        else:
            self.fc1 = nn.Linear(HIDDEN, FFN, dtype=F64)
            self.fc2 = nn.Linear(FFN, HIDDEN, dtype=F64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


def blocks(split: bool, n: int = N_BLOCKS, seed: int = 0) -> list[MLPBlock]:
    """``n`` blocks; split and plain builds with one seed hold identical weights (same init as nn.Linear)."""
    torch.manual_seed(seed)
    return [MLPBlock(split) for _ in range(n)]


def data(three_d: bool, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of ``N_MICROBATCHES`` microbatches: ``(8, HIDDEN)`` tokens or ``(8, 3, HIDDEN)`` sequences."""
    g = torch.Generator().manual_seed(100 + step)
    shape = (2 * N_MICROBATCHES, 3, HIDDEN) if three_d else (2 * N_MICROBATCHES, HIDDEN)
    return torch.randn(shape, dtype=F64, generator=g), torch.randn(shape, dtype=F64, generator=g)


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, target)


def reference(x: torch.Tensor, y: torch.Tensor, *, drop: int | None = None) -> tuple[list[float], dict]:
    """Per-microbatch losses and ``{"<block>.<param>": grad}`` of plain torch blocks, one process.

    PyTorch's schedules backpropagate each microbatch's loss and divide the gradients by the number of
    microbatches: the gradient of the mean microbatch loss. ``drop`` leaves one microbatch's gradient out.
    """
    model = nn.Sequential(*blocks(split=False))
    losses, total = [], 0
    for i, (xm, ym) in enumerate(zip(x.chunk(N_MICROBATCHES), y.chunk(N_MICROBATCHES), strict=True)):
        loss = loss_fn(model(xm), ym)
        losses.append(loss.item())
        if i != drop:
            total = total + loss
    (total / N_MICROBATCHES).backward()
    return losses, {name: p.grad.clone() for name, p in model.named_parameters()}


def local_grads(held: dict[int, nn.Module]) -> dict[str, torch.Tensor]:
    """``{"<block>.<param>": grad}`` of the blocks this rank holds (the reference's parameter names)."""
    out = {}
    for b, block in held.items():
        for name, p in block.named_parameters():
            if p.grad is None:
                raise AssertionError(f"block {b} parameter {name} got no gradient")
            if p.grad.grad_fn is not None or p.grad.requires_grad:
                raise AssertionError(f"block {b} parameter {name}: its gradient joined an autograd graph")
            out[f"{b}.{name}"] = p.grad.clone()
    return out


def expected_for(held: dict[int, nn.Module], ref: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in ref.items() if int(k.split(".")[0]) in held}


def layout(schedule: str, rank: int, world: int, per_rank: int = 2) -> tuple[int, list[int]]:
    """``(n_stages, this rank's stages)``: one stage per rank for 1F1B, ``per_rank`` for the zero-bubble ones."""
    if schedule == "1f1b":
        return world, [rank]
    n_stages = per_rank * world
    if schedule == "zbv":  # V: rank r holds stages r and n_stages - 1 - r
        return n_stages, sorted([rank, n_stages - 1 - rank])
    return n_stages, list(range(rank, n_stages, world))  # interleaved: round robin


def build(
    schedule: str,
    rank: int,
    world: int,
    *,
    split: bool,
    group: dist.ProcessGroup | None = None,
    per_rank: int = 2,
) -> tuple[object, dict[int, nn.Module], list[PipelineStage]]:
    """Stages of this rank over the ``N_BLOCKS``-block model (evenly cut), PyTorch's schedule around them.

    Returns:
        ``(schedule, {block index: block} held by this rank, this rank's stages)``.
    """
    n_stages, mine = layout(schedule, rank, world, per_rank)
    all_blocks = blocks(split)
    per = N_BLOCKS // n_stages
    held = {b: all_blocks[b] for s in mine for b in range(s * per, (s + 1) * per)}
    stages = []
    for s in mine:
        module = nn.Sequential(*all_blocks[s * per : (s + 1) * per])
        if split:
            stages.append(splitgrad_pipeline_stage(module, s, n_stages, "cpu", group=group))
        else:
            stages.append(PipelineStage(module, s, n_stages, torch.device("cpu"), group=group))
    cls = SCHEDULES[schedule]
    if schedule == "1f1b":
        sched = cls(stages[0], N_MICROBATCHES, loss_fn=loss_fn)
    else:
        sched = cls(stages, N_MICROBATCHES, loss_fn=loss_fn)
    return sched, held, stages


def step(sched, rank_has: tuple[bool, bool], x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    first, last = rank_has
    losses: list[torch.Tensor] = []
    kwargs = {"target": y, "losses": losses} if last else {}
    if first:
        sched.step(x, **kwargs)
    else:
        sched.step(**kwargs)
    return losses


# -- two-rank checks ----------------------------------------------------------------------------------------
def _matches_reference(schedule: str, three_d: bool, rank: int, world: int) -> None:
    sched, held, stages = build(schedule, rank, world, split=True)
    n_stages = stages[0].num_stages
    has = (any(st.stage_index == 0 for st in stages), any(st.stage_index == n_stages - 1 for st in stages))
    for step_no in range(2):  # the second step proves the per-step state resets cleanly
        for block in held.values():
            block.zero_grad(set_to_none=True)
        x, y = data(three_d, step_no)
        losses = step(sched, has, x, y)
        ref_losses, ref_grads = reference(x, y)
        for st in stages:
            if st.pending_microbatches:
                raise AssertionError(f"stage {st.stage_index} still owes W of {st.pending_microbatches}")
            splitgrad.ensure_no_pending_wgrad(st.submod, what="the end of the step")
        if has[1]:
            got = [v.detach().item() for v in losses]
            if got != ref_losses:  # the forward arithmetic is identical: bitwise
                raise AssertionError(f"{schedule}: losses {got} != reference {ref_losses}")
        what = f"{schedule} {'3-D' if three_d else '2-D'} step {step_no} rank {rank}"
        assert_grads_close(
            local_grads(held), expected_for(held, ref_grads), rtol=1e-13, atol=1e-15, what=what
        )


def _make_match(schedule: str, three_d: bool) -> Callable[[int, int], None]:
    def check(rank: int, world: int) -> None:
        _matches_reference(schedule, three_d, rank, world)

    check.__name__ = f"matches_reference_{schedule}_{'3d' if three_d else '2d'}"
    return check


TWO_RANK = [_make_match(s, d) for s in SCHEDULES for d in (False, True)]


# -- one-rank checks (in a per-rank group) ------------------------------------------------------------------
def native_split_fails_on_3d(rank: int, world: int, group: dist.ProcessGroup) -> None:
    """PyTorch's own I/W split detaches stage outputs in place: views (3-D F.linear outputs) make it raise.

    A middle stage's output must be a view, so four one-block stages on this rank. The same plain-torch model
    on 2-D tokens runs: the failure is the in-place detach, not the model.
    """
    sched, _, _ = build("interleaved_zb", 0, 1, split=False, group=group, per_rank=4)
    x, y = data(False, 0)
    step(sched, (True, True), x, y)
    sched, _, _ = build("interleaved_zb", 0, 1, split=False, group=group, per_rank=4)
    x, y = data(True, 0)
    try:
        step(sched, (True, True), x, y)
    except RuntimeError as exc:
        chain, e = [], exc
        while e is not None:
            chain.append(str(e))
            e = e.__cause__ or e.__context__
        if not any("Can't detach views in-place" in m for m in chain):
            raise AssertionError(f"native split failed differently: {chain}") from exc
    else:
        raise AssertionError(
            "PyTorch's native I/W split ran on 3-D activations; the documented bug is fixed?"
        )


def one_rank_zbv_matches_reference(rank: int, world: int, group: dist.ProcessGroup) -> None:
    """Both stages on one rank: the V schedule hands activations and gradients over locally."""
    sched, held, _ = build("zbv", 0, 1, split=True, group=group)
    x, y = data(True, 1)
    step(sched, (True, True), x, y)
    _, ref = reference(x, y)
    assert_grads_close(
        local_grads(held), expected_for(held, ref), rtol=1e-13, atol=1e-15, what="one-rank zbv"
    )


def swapped_runner_is_refused(rank: int, world: int, group: dist.ProcessGroup) -> None:
    """If PyTorch ever ran microbatch j's runner for W(i), the stage raises instead of mixing microbatches.

    Sabotage: stage 0's first W is held back, and the next W is handed that older microbatch's runner.
    """
    sched, _, stages = build("interleaved_zb", 0, 1, split=True, group=group)
    target = stages[0]
    original = target.backward_weight_one_chunk
    held_back: list[int] = []

    def swapping_w(bwd_chunk_id: int, last_backward: bool = False) -> None:
        if not held_back:
            held_back.append(bwd_chunk_id)
            return
        runners = target.dw_runner
        runners[bwd_chunk_id], runners[held_back[0]] = runners[held_back[0]], runners[bwd_chunk_id]
        original(bwd_chunk_id, last_backward=last_backward)

    target.backward_weight_one_chunk = swapping_w
    x, y = data(False, 0)
    try:
        step(sched, (True, True), x, y)
    except RuntimeError as exc:
        if "W runner of microbatch" not in str(exc):
            raise AssertionError(f"swapped runner failed differently: {exc}") from exc
    else:
        raise AssertionError("a W runner swapped between microbatches was not refused")
    finally:
        _discard_owed(stages)


def skipped_w_is_visible_and_refused(rank: int, world: int, group: dist.ProcessGroup) -> None:
    """A W that never runs: the gradient is wrong (and the comparison says so), the debt is visible, and
    the next step refuses to start."""
    sched, held, stages = build("interleaved_zb", 0, 1, split=True, group=group)
    target = stages[0]
    original = target.backward_weight_one_chunk

    def skipping_w(bwd_chunk_id: int, last_backward: bool = False) -> None:
        if bwd_chunk_id != 1:
            original(bwd_chunk_id, last_backward=last_backward)

    target.backward_weight_one_chunk = skipping_w
    x, y = data(False, 0)
    step(sched, (True, True), x, y)
    try:
        if target.pending_microbatches != (1,):
            raise AssertionError(f"expected microbatch 1 owed, got {target.pending_microbatches}")
        expect_error(RuntimeError, "still pending", lambda: splitgrad.ensure_no_pending_wgrad(target.submod))
        _, ref = reference(x, y)
        stage0 = {b: held[b] for b in (0, 1)}  # stage 0 holds blocks 0 and 1; stage 1 ran all its W's
        got = local_grads(stage0)
        # Not trivially passing: the comparison rejects the gradient missing one microbatch ...
        expect_error(
            AssertionError,
            "",
            lambda: assert_grads_close(got, expected_for(stage0, ref), rtol=1e-13, atol=1e-15),
        )
        # ... and accepts it against the reference without that microbatch.
        _, ref_drop = reference(x, y, drop=1)
        assert_grads_close(got, expected_for(stage0, ref_drop), rtol=1e-13, atol=1e-15, what="drop 1")
        expect_error(RuntimeError, "never ran", lambda: step(sched, (True, True), x, y))
    finally:
        _discard_owed(stages)


def misuse_is_refused(rank: int, world: int, group: dist.ProcessGroup) -> None:
    """Fused main_grad with PyTorch's .grad scaling, and torch DDP around a stage, are clear errors."""
    torch.manual_seed(0)
    fused = nn.Sequential(
        splitgrad.Linear(
            HIDDEN, HIDDEN, delay_wgrad_compute=True, fuse_wgrad_accumulation=True, params_dtype=F64
        )
    )
    fused[0].weight.main_grad = torch.zeros_like(fused[0].weight)
    stage = splitgrad_pipeline_stage(fused, 0, 1, "cpu", group=group)
    expect_error(RuntimeError, "scale_grads=False", lambda: stage.scale_grads(4))
    stage.scale_grads(1)  # no scaling asked: nothing to refuse
    plain = nn.Sequential(splitgrad.Linear(HIDDEN, HIDDEN, delay_wgrad_compute=True, params_dtype=F64))
    ddp = nn.parallel.DistributedDataParallel(plain, process_group=group)
    expect_error(
        ValueError, "DistributedDataParallel", lambda: splitgrad_pipeline_stage(ddp, 0, 1, "cpu", group=group)
    )


ONE_RANK = [
    native_split_fails_on_3d,
    one_rank_zbv_matches_reference,
    swapped_runner_is_refused,
    skipped_w_is_visible_and_refused,
    misuse_is_refused,
]


def _discard_owed(stages: list[SplitgradPipelineStage]) -> None:
    for st in stages:
        st.discard_pending_wgrad()


# -- driver -------------------------------------------------------------------------------------------------
def run_checks(rank: int, world: int, names: list[str]) -> dict[str, str | None]:
    """Run the named checks in order; after the first failure on any rank the rest are reported as not run."""
    groups = [dist.new_group([r]) for r in range(world)]  # collective: every rank creates every group
    table: dict[str, Callable[[], None]] = {f.__name__: (lambda f=f: f(rank, world)) for f in TWO_RANK}
    table.update({f.__name__: (lambda f=f: f(rank, world, groups[rank])) for f in ONE_RANK})
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


ALL = [f.__name__ for f in TWO_RANK + ONE_RANK]
