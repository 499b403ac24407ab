"""Pipeline runtime x FSDP2 checks on 4 gloo ranks (pp=2 x fsdp=2); imported by the spawned children.

Each pipeline rank's stage is ``fully_shard``-ed over its data-parallel group and wrapped in
:class:`splitgrad.parallel.FSDPStage`; gradients (sharded DTensors, ``full_tensor()``) must equal a float64
single-process reference of the whole batch, for 1f1b (W inside B) and zb-h1 (deferred W; the reduce-scatter
run by the stage's RF action or started in the background at its last W, and seen as its own comm events in
the measured timeline). PyTorch's ScheduleZBVZeroBubble and ScheduleInterleavedZeroBubble run the same model
through the splitgrad adapter.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

import splitgrad
from splitgrad.parallel import FSDPStage
from splitgrad.pipeline import build_runtime, pipeline_groups
from splitgrad.pipeline.build import sequential_stages
from splitgrad.pipeline.measure import idle_breakdown
from splitgrad.pipeline.timeline import to_chrome_trace

F64 = torch.float64
D, N_MB, MB, PP, DP = 8, 4, 3, 2, 2


def blocks(delay: bool) -> list[nn.Module]:
    torch.manual_seed(0)
    out: list[nn.Module] = []
    for _ in range(4):
        out += [splitgrad.Linear(D, D, delay_wgrad_compute=delay, params_dtype=F64), nn.Tanh()]
    return out


def batch(dp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(50 + dp_rank)
    return torch.randn(N_MB * MB, D, generator=g, dtype=F64), torch.randn(
        N_MB * MB, D, generator=g, dtype=F64
    )


def loss_fn(y: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(y, t)


def reference() -> list[torch.Tensor]:
    model = nn.Sequential(*blocks(False))
    total = 0
    for d in range(DP):
        x, t = batch(d)
        total = total + sum(loss_fn(model(xm), tm) for xm, tm in zip(x.chunk(N_MB), t.chunk(N_MB))) / N_MB
    (total / DP).backward()
    return [p.grad for p in model.parameters()]


def _check_reduce_scatter_events(events: list, stage: int, reduction: str, n_groups: int, what: str) -> None:
    """The timeline holds one ``grad-sync`` reduce-scatter event per FSDP group of ``stage``, after its last W began
    (``"async"``: started by the hooks inside it) or after it ended (``"finish"``: run by the ``RF`` action),
    and ended by the end of ``RF``."""
    mine = [e for e in events if e.stage == stage]
    last_w = max((e for e in mine if e.kind == "W"), key=lambda e: e.end)
    rf = next(e for e in mine if e.name == f"{stage}RF")
    rs = [e for e in mine if e.kind == "grad-sync" and e.name.startswith("reduce-scatter")]
    if len(rs) != n_groups:
        raise AssertionError(
            f"{what}: {len(rs)} reduce-scatter events for stage {stage}, want {n_groups}: {rs}"
        )
    earliest = rf.start if reduction == "finish" else last_w.start
    for e in rs:
        if not (earliest <= e.start <= e.end <= rf.end):
            raise AssertionError(f"{what}: {e} not within [{earliest}, {rf.end}] (last W {last_w}, RF {rf})")
    if reduction == "finish" and min(e.start for e in rs) < last_w.end:
        raise AssertionError(f"{what}: a reduce-scatter began before the stage's last W ended")
    # On the trace's comm thread of the rank; not mistaken for receive waits by the idle breakdown.
    trace = to_chrome_trace(events, us_per_unit=1e6)["traceEvents"]
    on_comm_thread = [
        t
        for t in trace
        if t.get("name", "").startswith("reduce-scatter") and t.get("tid") == 2 * rs[0].rank + 1
    ]
    if len(on_comm_thread) != n_groups:
        raise AssertionError(f"{what}: reduce-scatters on the trace's comm thread: {on_comm_thread}")
    without = [e for e in events if e.kind != "grad-sync"]
    if idle_breakdown(events) != idle_breakdown(without):
        raise AssertionError(f"{what}: reduce-scatter events changed the idle breakdown")


def check_pipeline_fsdp(rank: int, world: int) -> None:
    """1f1b (W inside B) and zb-h1 with the deferred reduce-scatter run by RF or started in the background."""
    g = pipeline_groups(pp_size=PP, dp_size=DP)
    mesh = DeviceMesh.from_group(g.dp_group, "cpu")
    ref = reference()
    n_params_per_stage = len(ref) // PP
    for schedule, reduction in (("1f1b", "finish"), ("zb-h1", "finish"), ("zb-h1", "async")):
        what = f"{schedule} {reduction}"
        stages = sequential_stages(blocks(delay=schedule != "1f1b"), PP)
        wrapped = []
        for stage in stages:
            for layer in stage:
                if isinstance(layer, splitgrad.Linear):
                    fully_shard(layer, mesh=mesh)
            fully_shard(stage, mesh=mesh)
            wrapped.append(FSDPStage(stage, reduction=reduction, timeout=120))
        rt = build_runtime(wrapped, schedule, n_microbatches=N_MB, loss_fn=loss_fn, pp_group=g.pp_group)
        # The sync points are in the schedule: R before each stage's last B, RF at the end (after the last W).
        kinds = [a.kind.value for a in rt.schedule.rank_actions[g.pp_rank]]
        if (
            kinds.count("R") != 1
            or kinds[-1] != "RF"
            or ("W" in kinds and kinds.index("RF") < len(kinds) - 1)
        ):
            raise AssertionError(f"{what}: sync points missing: {kinds}")
        x, t = batch(g.dp_rank)
        result = rt.step(x, t)
        mine = wrapped[g.pp_rank].module
        if splitgrad.pending_wgrad(mine) != 0 or wrapped[g.pp_rank].reduction.in_flight:
            raise AssertionError(f"{what}: wgrad work or a reduction left")
        if schedule == "zb-h1":
            _check_reduce_scatter_events(result.events, g.pp_rank, reduction, 2, what)
        got = [p.grad.full_tensor() for p in mine.parameters()]
        want = ref[g.pp_rank * n_params_per_stage : (g.pp_rank + 1) * n_params_per_stage]
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            torch.testing.assert_close(
                a, b, rtol=1e-12, atol=1e-12, msg=lambda m, i=i, w=what: f"{w} param {i}: {m}"
            )
        # Not trivially passing: the other replica's data alone gives a different gradient.
        if torch.allclose(got[0], want[0] * 2, rtol=1e-6, atol=1e-9):
            raise AssertionError("reference is degenerate")
        rt.close()
        for w in wrapped:
            w.reduction.remove()


def _torch_zero_bubble_with_fsdp(schedule_cls: type, local: list[int], what: str) -> None:
    """PyTorch's ``schedule_cls`` with splitgrad adapter stages ``local`` (of 4), each fully_shard-ed over dp."""
    from splitgrad.parallel import defer_fsdp_reduction
    from splitgrad.pipeline.torch_adapter import splitgrad_pipeline_stage

    g = pipeline_groups(pp_size=PP, dp_size=DP)
    mesh = DeviceMesh.from_group(g.dp_group, "cpu")
    ref = reference()
    all_stages = sequential_stages(blocks(delay=True), 2 * PP)
    stages, reduced = [], []
    for s in local:
        module = all_stages[s]
        fully_shard(module[0], mesh=mesh)
        fully_shard(module, mesh=mesh)
        defer_fsdp_reduction(module)
        stage = splitgrad_pipeline_stage(module, s, 2 * PP, "cpu", group=g.pp_group)
        original = stage.perform_reduce_grad

        def counted(factor: int, original=original, s=s) -> None:
            reduced.append(s)
            original(factor)

        stage.perform_reduce_grad = counted
        stages.append(stage)
    schedule = schedule_cls(stages, n_microbatches=N_MB, loss_fn=loss_fn)
    x, t = batch(g.dp_rank)
    # The first stage's rank feeds the inputs, the last stage's rank the targets (both rank 0 in a V).
    schedule.step(*((x,) if 0 in local else ()), **({"target": t} if 2 * PP - 1 in local else {}))
    if sorted(reduced) != local:
        raise AssertionError(f"{what}: REDUCE_GRAD ran for stages {reduced}, expected {local}")
    per_stage = len(ref) // (2 * PP)  # one Linear (weight, bias) per stage
    for s, stage in zip(local, stages, strict=True):
        if splitgrad.pending_wgrad(stage.submod) != 0:
            raise AssertionError(f"{what}: stage {s}: wgrad work left")
        got = [p.grad.full_tensor() for p in stage.submod.parameters()]
        want = ref[s * per_stage : (s + 1) * per_stage]
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            torch.testing.assert_close(
                a, b, rtol=1e-12, atol=1e-12, msg=lambda m, i=i, s=s: f"{what} stage {s} param {i}: {m}"
            )


def check_torch_zbv_with_fsdp(rank: int, world: int) -> None:
    """PyTorch's ScheduleZBVZeroBubble (V layout: stages r and 3 - r); an FSDP2 stage needs the glue."""
    from torch.distributed.pipelining import ScheduleZBVZeroBubble

    from splitgrad.pipeline.torch_adapter import splitgrad_pipeline_stage

    g = pipeline_groups(pp_size=PP, dp_size=DP)
    mesh = DeviceMesh.from_group(g.dp_group, "cpu")
    local = sorted((g.pp_rank, 2 * PP - 1 - g.pp_rank))
    # Without defer_fsdp_reduction the adapter refuses an FSDP2 stage, naming the call.
    bare = sequential_stages(blocks(delay=True), 2 * PP)[local[0]]
    fully_shard(bare, mesh=mesh)
    try:
        splitgrad_pipeline_stage(bare, local[0], 2 * PP, "cpu", group=g.pp_group)
    except ValueError as exc:
        if "defer_fsdp_reduction" not in str(exc):
            raise
    else:
        raise AssertionError("an FSDP2 stage without defer_fsdp_reduction was accepted")
    _torch_zero_bubble_with_fsdp(ScheduleZBVZeroBubble, local, "ZBV")


def check_torch_interleaved_zb_with_fsdp(rank: int, world: int) -> None:
    """PyTorch's ScheduleInterleavedZeroBubble (loop layout: stages r and r + 2)."""
    from torch.distributed.pipelining import ScheduleInterleavedZeroBubble

    g = pipeline_groups(pp_size=PP, dp_size=DP)
    _torch_zero_bubble_with_fsdp(ScheduleInterleavedZeroBubble, [g.pp_rank, g.pp_rank + PP], "interleaved ZB")


CHECKS = [check_pipeline_fsdp, check_torch_zbv_with_fsdp, check_torch_interleaved_zb_with_fsdp]
