"""Pipeline runtime x FSDP2 checks on 4 gloo ranks (pp=2 x fsdp=2); imported by the spawned children.

Each pipeline rank's stage is ``fully_shard``-ed over its data-parallel group and wrapped in
:class:`splitgrad.parallel.FSDPStage`; gradients (sharded DTensors, ``full_tensor()``) must equal a float64
single-process reference of the whole batch, for 1f1b (W inside B) and zb-h1 (deferred W, reduce-scatter at
each stage's last W).
"""

from __future__ import annotations

import traceback

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

import splitgrad
from splitgrad.parallel import FSDPStage
from splitgrad.pipeline import build_runtime, pipeline_groups
from splitgrad.pipeline.build import sequential_stages

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


def check_pipeline_fsdp(rank: int, world: int) -> None:
    g = pipeline_groups(pp_size=PP, dp_size=DP)
    mesh = DeviceMesh.from_group(g.dp_group, "cpu")
    ref = reference()
    n_params_per_stage = len(ref) // PP
    for schedule in ("1f1b", "zb-h1"):
        stages = sequential_stages(blocks(delay=schedule != "1f1b"), PP)
        wrapped = []
        for stage in stages:
            for layer in stage:
                if isinstance(layer, splitgrad.Linear):
                    fully_shard(layer, mesh=mesh)
            fully_shard(stage, mesh=mesh)
            wrapped.append(FSDPStage(stage))
        rt = build_runtime(wrapped, schedule, n_microbatches=N_MB, loss_fn=loss_fn, pp_group=g.pp_group)
        # The sync points are in the schedule: R before each stage's last B, RF at the end. FSDPStage's
        # finish_grad_sync (at RF) raises if a deferred gradient was not reduced by then, i.e. in the last W.
        kinds = [a.kind.value for a in rt.schedule.rank_actions[g.pp_rank]]
        if kinds.count("R") != 1 or kinds[-1] != "RF":
            raise AssertionError(f"{schedule}: sync points missing: {kinds}")
        x, t = batch(g.dp_rank)
        rt.step(x, t)
        mine = wrapped[g.pp_rank].module
        if splitgrad.pending_wgrad(mine) != 0:
            raise AssertionError(f"{schedule}: wgrad work left")
        got = [p.grad.full_tensor() for p in mine.parameters()]
        want = ref[g.pp_rank * n_params_per_stage : (g.pp_rank + 1) * n_params_per_stage]
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            torch.testing.assert_close(
                a, b, rtol=1e-12, atol=1e-12, msg=lambda m, i=i, s=schedule: f"{s} param {i}: {m}"
            )
        # Not trivially passing: the other replica's data alone gives a different gradient.
        if torch.allclose(got[0], want[0] * 2, rtol=1e-6, atol=1e-9):
            raise AssertionError("reference is degenerate")
        rt.close()


def check_torch_zbv_with_fsdp(rank: int, world: int) -> None:
    """PyTorch's ScheduleZBVZeroBubble with splitgrad adapter stages, each fully_shard-ed over dp (4 stages)."""
    from torch.distributed.pipelining import ScheduleZBVZeroBubble

    from splitgrad.parallel import defer_fsdp_reduction
    from splitgrad.pipeline.torch_adapter import splitgrad_pipeline_stage

    g = pipeline_groups(pp_size=PP, dp_size=DP)
    mesh = DeviceMesh.from_group(g.dp_group, "cpu")
    ref = reference()
    all_stages = sequential_stages(blocks(delay=True), 2 * PP)
    local = sorted((g.pp_rank, 2 * PP - 1 - g.pp_rank))  # V layout
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
    schedule = ScheduleZBVZeroBubble(stages, n_microbatches=N_MB, loss_fn=loss_fn)
    x, t = batch(g.dp_rank)
    if g.pp_rank == 0:
        schedule.step(x, target=t)
    else:
        schedule.step()
    if sorted(reduced) != local:
        raise AssertionError(f"REDUCE_GRAD ran for stages {reduced}, expected {local}")
    per_stage = len(ref) // (2 * PP)  # one Linear (weight, bias) per stage
    for s, stage in zip(local, stages, strict=True):
        if splitgrad.pending_wgrad(stage.submod) != 0:
            raise AssertionError(f"stage {s}: wgrad work left")
        got = [p.grad.full_tensor() for p in stage.submod.parameters()]
        want = ref[s * per_stage : (s + 1) * per_stage]
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            torch.testing.assert_close(
                a, b, rtol=1e-12, atol=1e-12, msg=lambda m, i=i, s=s: f"stage {s} param {i}: {m}"
            )


CHECKS = [check_pipeline_fsdp, check_torch_zbv_with_fsdp]


def run_checks(rank: int, world: int, names: list[str]) -> dict[str, str | None]:
    table = {f.__name__: f for f in CHECKS}
    results: dict[str, str | None] = {}
    for name in names:
        try:
            table[name](rank, world)
            results[name] = None
        except Exception:
            results[name] = traceback.format_exc()
    return results
