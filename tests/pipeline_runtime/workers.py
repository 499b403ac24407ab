"""Per-rank bodies of the distributed runtime tests (module-level so the spawn harness can pickle them).

Every check compares the pipeline's loss and every local parameter gradient with a float64 single-process
reference (the plain-autograd twin of the same seeded model over all microbatches, loss = mean over
microbatches). Ranks return plain dicts; the test process asserts, so one failing schedule does not hide
the others.
"""

from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import splitgrad
from splitgrad.models import (
    GPT,
    GPTConfig,
    MoEConfig,
    MoEGPT,
    lm_loss,
    reference_twin,
    set_aux_loss_scale,
    split_into_stages,
)
from splitgrad.parallel import DDPConfig
from splitgrad.pipeline import build_schedule
from splitgrad.pipeline.runtime import PipelineRuntime, build_runtime, pipeline_groups, sequential_stages
from splitgrad.pipeline.runtime.comm import PipelineComm
from splitgrad.pipeline.timeline import (
    measured_bubble_ratio,
    overhead_split,
    replay_measured,
    simulate_measured,
)

RTOL, ATOL = 1e-10, 1e-12
VOCAB, SEQ, MB = 37, 8, 2

#: (schedule name, stages per rank) of every family the runtime must run.
SCHEDULES = (
    ("gpipe", 1),
    ("1f1b", 1),
    ("interleaved-1f1b", 2),
    ("zb-h1", 1),
    ("zb-h2", 1),
    ("zbv", 2),
    ("dualpipev", 2),
    ("zb-auto", 1),
)
#: Families whose schedules contain W actions (so the runtime must run deferred work there).
SPLIT = {"zb-h1", "zb-h2", "zbv", "dualpipev", "zb-auto"}


def gpt_model(
    n_stages: int, *, moe: bool = False, fused: bool = False, seed: int = 0
) -> tuple[GPT, list[nn.Module]]:
    """A seeded float64 GPT (or MoE) with deferred wgrad, cut into ``n_stages`` stages."""
    layers = max(2, n_stages)  # a block on every stage, so every rank has deferred work
    kwargs = dict(
        vocab_size=VOCAB,
        seq_len=16,
        hidden_size=32,
        num_layers=layers,
        num_heads=4,
        ffn_hidden_size=48,
        params_dtype=torch.float64,
        delay_wgrad_compute=True,
        fuse_wgrad_accumulation=fused,
    )
    if moe:
        config = MoEConfig(**kwargs, num_experts=4, top_k=2, moe_ffn_hidden_size=24, aux_loss_coef=0.1)
    else:
        config = GPTConfig(**kwargs)
    torch.manual_seed(seed)
    model = (MoEGPT if moe else GPT)(config)
    with torch.no_grad():  # jitter so norm scales/biases are not the trivial 1/0
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model, split_into_stages(model, n_stages)


def token_batch(
    n_microbatches: int, seed: int, *, mb: int = MB, seq: int = SEQ
) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shape = (n_microbatches * mb, seq)
    return torch.randint(0, VOCAB, shape, generator=gen), torch.randint(0, VOCAB, shape, generator=gen)


def gpt_reference(model: GPT, ids_list, tgt_list) -> tuple[float, dict[str, torch.Tensor]]:
    """Mean CE over microbatches and every gradient of ``mean(CE + aux)``, by the plain-autograd twin."""
    twin = reference_twin(model)
    total, ce = 0.0, []
    for ids, tgt in zip(ids_list, tgt_list):
        logits, aux = twin(ids)
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), tgt.reshape(-1))
        total = total + (loss + aux) / len(ids_list)
        ce.append(loss.detach())
    total.backward()
    return torch.stack(ce).mean().item(), {n: p.grad for n, p in twin.named_parameters()}


def compare(model: nn.Module, runtime: PipelineRuntime, ref: dict[str, torch.Tensor]) -> dict:
    """Mismatching parameter names of this rank's stages against ``ref`` (``.grad``, else ``main_grad``)."""
    names = {id(p): n for n, p in model.named_parameters()}
    bad, checked, worst = [], 0, 0.0
    for p in runtime.parameters():
        name = names[id(p)]
        got = p.grad if p.grad is not None else getattr(p, "main_grad", None)
        want = ref[name]
        checked += 1
        if got is None or want is None:
            if not (got is None and want is None):
                bad.append(f"{name}: missing")
            continue
        worst = max(worst, (got - want).abs().max().item())
        if not torch.allclose(got, want, rtol=RTOL, atol=ATOL):
            bad.append(f"{name}: max err {(got - want).abs().max().item():.3g}")
    return {"bad": bad, "checked": checked, "worst": worst}


def run_gpt_check(
    name: str,
    per_rank: int,
    n_ranks: int,
    m: int | None = None,
    *,
    moe: bool = False,
    seed: int = 0,
    pp_group=None,
    dp_group=None,
    dp_rank: int = 0,
    dp_size: int = 1,
    split_backward: bool = False,
) -> dict:
    n_stages = per_rank * n_ranks
    if m is None:  # dualpipev needs at least as many microbatches as stages
        m = max(4, n_stages) if name == "dualpipev" else 4
    model, stages = gpt_model(n_stages, moe=moe, fused=dp_group is not None, seed=seed)
    if moe:
        set_aux_loss_scale(model, 1.0 / m)
    # Every replica's data, so each rank can build the full reference.
    batches = [token_batch(m, seed=100 + d) for d in range(dp_size)]
    ref_loss, ref = gpt_reference(
        model, *zip(*[(i, t) for b in batches for i, t in zip(b[0].split(MB), b[1].split(MB))])
    )
    ddp = DDPConfig(bucket_size=2000) if dp_group is not None else None
    rt = build_runtime(
        stages,
        name,
        n_microbatches=m,
        loss_fn=lm_loss,
        pp_group=pp_group,
        dp_group=dp_group,
        ddp=ddp,
        timeout=60,
        schedule_options={"split_backward": True} if split_backward else None,
    )
    ids, tgt = batches[dp_rank]
    result = rt.step(ids, tgt)
    # The replica's own loss is the mean over its microbatches; compare with the reference on its data.
    own_loss = gpt_reference(model, ids.split(MB), tgt.split(MB))[0] if dp_size > 1 else ref_loss
    out = compare(model, rt, ref)
    out.update(loss=result.loss.item(), ref_loss=own_loss, w_tasks=result.w_tasks)
    out["launched_early"] = [m_.last_launched_early for m_ in rt.grad_sync.values()]
    for m_ in rt.grad_sync.values():
        m_.remove_hooks()
    return out


def two_rank_worker(rank: int, world: int, out_dir: str) -> dict:
    """Every schedule on 2 ranks, an MLP stack, MoE, shape renegotiation, memory, timeline, a negative check."""
    results: dict[str, dict] = {}
    m = 4
    for name, per_rank in SCHEDULES:
        results[name] = run_gpt_check(name, per_rank, world)
    results["1f1b split_backward"] = run_gpt_check("1f1b", 1, world, m, seed=3, split_backward=True)
    results["zb-h1 moe"] = run_gpt_check("zb-h1", 1, world, m, moe=True, seed=4)
    results["mlp"] = mlp_check(rank, world)
    results["reshape"] = reshape_check(world)
    results["memory"] = memory_check(world)
    results["timeline"] = timeline_check(rank, world, out_dir)
    results["negative"] = negative_check(world)
    results["posting"] = posting_order_check(world)
    results["bitwise"] = bitwise_family_check(world)
    results["auto"] = auto_check(world)
    results["group size"] = group_size_check(rank, world)
    results["shape change"] = shape_change_check(world)
    return results


def four_rank_worker(rank: int, world: int) -> dict:
    """Every schedule on pp=4, then every schedule on pp=2 x dp=2 with splitgrad DDP (fused main_grad)."""
    results: dict[str, dict] = {}
    for name, per_rank in SCHEDULES:
        results[f"pp4 {name}"] = run_gpt_check(name, per_rank, world)
    groups = pipeline_groups(2, 2)
    for name, per_rank in SCHEDULES:
        results[f"pp2xdp2 {name}"] = run_gpt_check(
            name,
            per_rank,
            2,
            pp_group=groups.pp_group,
            dp_group=groups.dp_group,
            dp_rank=groups.dp_rank,
            dp_size=2,
        )
    return results


def group_size_check(rank: int, world: int) -> dict:
    """Schedules whose rank count differs from the pipeline group's are refused at build time, by name.

    Returns the error messages (None where building succeeded) and, as the positive case, the loss and
    gradients of a one-rank schedule run on a one-rank group of its own next to the reference.
    """
    blocks = mlp_blocks(delay=True)
    one, two = sequential_stages(blocks, 1), sequential_stages(blocks, 2, sizes=[4, 3])
    errors = {
        "build 1-rank schedule, 2-rank default group": _build_error(
            lambda: build_runtime(one, "1f1b", n_microbatches=2, loss_fn=F.mse_loss)
        ),
        "PipelineRuntime 1-rank schedule, 2-rank default group": _build_error(
            lambda: PipelineRuntime(one, build_schedule("gpipe", 1, 2), loss_fn=F.mse_loss)
        ),
        "build 2-rank schedule, wrong rank": _build_error(
            lambda: build_runtime(two, "1f1b", n_microbatches=2, loss_fn=F.mse_loss, rank=1 - rank)
        ),
    }
    # Every rank creates every group (new_group is collective); each runs its own one-rank pipeline.
    solo = [dist.new_group([r]) for r in range(world)][rank]
    rt = build_runtime(one, "1f1b", n_microbatches=2, loss_fn=F.mse_loss, pp_group=solo)
    gen = torch.Generator().manual_seed(21)
    x = torch.randn(4, 12, generator=gen, dtype=torch.float64)
    y = torch.randn(4, 5, generator=gen, dtype=torch.float64)
    result = rt.step(x, y)
    reference = nn.Sequential(*mlp_blocks(delay=False))
    loss = torch.stack([F.mse_loss(reference(a), b) for a, b in zip(x.split(2), y.split(2))]).mean()
    loss.backward()
    out = compare(nn.Sequential(*blocks), rt, {n: p.grad for n, p in reference.named_parameters()})
    out.update(errors=errors, loss=result.loss.item(), ref_loss=loss.item(), w_tasks=result.w_tasks)
    return out


def _build_error(build) -> str | None:
    try:
        build()
    except (ValueError, RuntimeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def mlp_blocks(*, delay: bool) -> list[nn.Module]:
    """Seeded splitgrad Linears mixed with torch layers (the same values for either ``delay``)."""
    torch.manual_seed(7)
    kw = {"delay_wgrad_compute": delay, "params_dtype": torch.float64}
    return [
        splitgrad.Linear(12, 24, **kw),
        nn.Tanh(),
        splitgrad.Linear(24, 24, **kw),
        nn.GELU(),
        nn.Linear(24, 24, dtype=torch.float64),
        nn.Tanh(),
        splitgrad.Linear(24, 5, **kw),
    ]


def mlp_check(rank: int, world: int) -> dict:
    """A plain ``nn.Sequential`` of splitgrad Linears and torch layers, 2-D activations, 4 stages (zbv)."""
    blocks = mlp_blocks(delay=True)
    reference = nn.Sequential(*mlp_blocks(delay=False))
    stages = sequential_stages(blocks, 4, sizes=[2, 2, 2, 1])
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(12, 12, generator=gen, dtype=torch.float64)
    y = torch.randn(12, 5, generator=gen, dtype=torch.float64)
    rt = build_runtime(stages, "zbv", n_microbatches=3, loss_fn=F.mse_loss, timeout=60)
    result = rt.step(x, y)
    loss = torch.stack([F.mse_loss(reference(a), b) for a, b in zip(x.split(4), y.split(4))]).mean()
    loss.backward()
    ref = {n: p.grad for n, p in reference.named_parameters()}
    out = compare(nn.Sequential(*blocks), rt, ref)
    out.update(loss=result.loss.item(), ref_loss=loss.item(), w_tasks=result.w_tasks)
    return out


class OverlapRecordingStage(nn.Sequential):
    """A stage that takes overlapped F+B pairs itself (backward part first: the order is its choice)."""

    def __init__(self, *blocks: nn.Module) -> None:
        super().__init__(*blocks)
        self.overlap_calls = 0

    def overlapped_forward_backward(self, x: torch.Tensor, y: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
        torch.autograd.backward(y, dy)
        self.overlap_calls += 1
        return self(x)


def bitwise_family_check(world: int) -> dict:
    """Every family (and dualpipev's overlapped pairs, through a stage hook and in order) on the MLP stack:
    per-parameter gradients and the loss, to be compared bitwise with 1f1b's by the test process."""
    gen = torch.Generator().manual_seed(12)
    x = torch.randn(16, 12, generator=gen, dtype=torch.float64)
    y = torch.randn(16, 5, generator=gen, dtype=torch.float64)
    runs = [(name, per_rank, {}, False) for name, per_rank in SCHEDULES]
    runs += [("dualpipev", 2, {"overlap": False}, False), ("dualpipev", 2, {}, True)]
    # A cost-aware V whose order differs from the fixed zbv's (B twice F, W half F).
    runs += [("zbv-auto", 2, {"f": 1.0, "b": 2.0, "w": 0.5}, False)]
    out: dict[str, dict] = {}
    for name, per_rank, options, hook in runs:
        blocks = mlp_blocks(delay=True)
        n_stages = per_rank * world
        sizes = [2, 2, 2, 1] if n_stages == 4 else [4, 3]
        stages = sequential_stages(blocks, n_stages, sizes=sizes)
        if hook:
            stages = [OverlapRecordingStage(*stage) for stage in stages]
        names = {id(p): n for n, p in nn.Sequential(*blocks).named_parameters()}
        rt = build_runtime(
            stages, name, n_microbatches=4, loss_fn=F.mse_loss, timeout=60, schedule_options=options or None
        )
        # Two steps: the first agrees the shapes (headers), the second posts every receive ahead; both must
        # give the same gradients bit for bit.
        first = rt.step(x, y)
        first_grads = {names[id(p)]: p.grad.clone() for p in rt.parameters()}
        first_calls = sum(getattr(m, "overlap_calls", 0) for m in rt.stages.values())
        rt.zero_grad()
        result = rt.step(x, y)
        label = name + (" no-overlap" if "overlap" in options else "") + (" costed" if "f" in options else "")
        label += " hook" if hook else ""
        out[label] = {
            "grads": {names[id(p)]: p.grad.clone() for p in rt.parameters()},
            "first_grads": first_grads,
            "headers": (first.comm.headers, result.comm.headers),
            "posted_ahead": (result.comm.posted_ahead, len(result.comm.receives)),
            "loss": result.loss.item(),
            "overlap_calls": sum(getattr(m, "overlap_calls", 0) for m in rt.stages.values()) - first_calls,
            "overlapped_actions": sum(a.kind.value == "FB" for a in rt.actions),
        }
    reference = nn.Sequential(*mlp_blocks(delay=False))
    loss = torch.stack([F.mse_loss(reference(a), b) for a, b in zip(x.split(4), y.split(4))]).mean()
    loss.backward()
    out["reference"] = {"grads": {n: p.grad for n, p in reference.named_parameters()}, "loss": loss.item()}
    return out


def auto_check(world: int) -> dict:
    """Profile-guided zb-auto on the MLP stack: profile step (1F1B split), plan, then two planned steps."""
    gen = torch.Generator().manual_seed(13)
    x = torch.randn(16, 12, generator=gen, dtype=torch.float64)
    y = torch.randn(16, 5, generator=gen, dtype=torch.float64)
    blocks = mlp_blocks(delay=True)
    stages = sequential_stages(blocks, world, sizes=[4, 3])
    rt = build_runtime(
        stages,
        "auto",
        n_microbatches=4,
        loss_fn=F.mse_loss,
        timeout=60,
        schedule_options={"memory_budget": 2.0},
    )
    before = rt.schedule.name
    first = rt.step(x, y)
    profiled = [p.grad.clone() for p in rt.parameters()]
    plan = rt.planner.plan
    rt.zero_grad()
    second = rt.step(x, y)
    report = rt.timeline_report(second)
    return {
        "before": before,
        "after": rt.schedule.name,
        "same_plan": rt.schedule.to_text(),
        "losses": (first.loss.item(), second.loss.item()),
        "bitwise": all(torch.equal(a, p.grad) for a, p in zip(profiled, rt.parameters())),
        "costs": plan.f + plan.b + plan.w,
        "bytes": plan.activation_bytes + plan.wgrad_bytes,
        "w_memory": plan.w_memory,
        "limits": plan.memory_limit,
        "predicted": plan.predicted_bubble,
        "peak_memory": simulate_plan_memory(plan),
        "report": report,
    }


def simulate_plan_memory(plan) -> float:
    from splitgrad.pipeline import simulate

    return max(simulate(plan.schedule, w_memory=plan.w_memory).peak_memory)


def reshape_check(world: int) -> dict:
    """One runtime, three steps: shapes agreed by headers on the first, new shapes after ``reset_shapes()`` on
    the second, and the third (same shapes) exchanges no header and posts every receive ahead of its use."""
    model, stages = gpt_model(world, seed=5)
    rt = build_runtime(stages, "zb-h1", n_microbatches=2, loss_fn=lm_loss, timeout=60)
    first = rt.step(*token_batch(2, seed=9)).comm
    rt.zero_grad()
    rt.reset_shapes()
    ids, tgt = token_batch(2, seed=10, mb=3, seq=5)
    second = rt.step(ids, tgt).comm
    rt.zero_grad()
    result = rt.step(ids, tgt)
    ref_loss, ref = gpt_reference(model, ids.split(3), tgt.split(3))
    out = compare(model, rt, ref)
    out.update(loss=result.loss.item(), ref_loss=ref_loss, w_tasks=result.w_tasks)
    third = result.comm
    out["stats"] = {
        "headers": [first.headers, second.headers, third.headers],
        "receives": len(third.receives),
        "posted_ahead": third.posted_ahead,
        "released_early": third.released_early,
        "peak_recv_bytes": third.peak_recv_bytes,
        "peak_send_bytes": third.peak_send_bytes,
        "lead_ok": all(r.posted <= r.needed <= r.done for r in third.receives),
    }
    return out


def shape_change_check(world: int) -> str:
    """A step whose activations change shape without ``reset_shapes()``: the sender names the action and the
    fix; its peer gives up after the (short) timeout. Runs last, on its own group: the peer's receives posted
    ahead stay pending in that group."""
    group = dist.new_group(list(range(world)))
    _model, stages = gpt_model(world, seed=5)
    rt = build_runtime(stages, "zb-h1", n_microbatches=2, loss_fn=lm_loss, timeout=3, pp_group=group)
    rt.step(*token_batch(2, seed=9))
    rt.zero_grad()
    try:
        rt.step(*token_batch(2, seed=10, mb=3, seq=5))
    except (ValueError, RuntimeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "ran"


def memory_check(world: int) -> dict:
    """Peak activation bytes (deterministic byte counts): GPipe keeps every microbatch, 1F1B only p."""
    peaks = {}
    for name in ("gpipe", "1f1b", "zb-h1"):
        _model, stages = gpt_model(world, seed=6)
        rt = build_runtime(stages, name, n_microbatches=6, loss_fn=lm_loss, timeout=60, track_memory=True)
        peaks[name] = rt.step(*token_batch(6, seed=11)).peak_activation_bytes
    return peaks


def timeline_check(rank: int, world: int, out_dir: str) -> dict:
    """Gather the measured events of a zb-h1 step, write Chrome trace + PNG, and report the bubble ratios."""
    _model, stages = gpt_model(world, seed=2)
    rt = build_runtime(stages, "zb-h1", n_microbatches=4, loss_fn=lm_loss, timeout=60)
    rt.step(*token_batch(4, seed=12))  # warm-up: connections, allocator
    result = rt.step(*token_batch(4, seed=12))
    events = rt.gather_timeline(result)
    report = rt.timeline_report(result, os.path.join(out_dir, "zb-h1"))
    if events is None:
        return {"rank": rank, "report": report}
    split = overhead_split(events, rt.schedule)
    return {
        "rank": rank,
        "report": report,
        "replay": replay_measured(events, rt.schedule).bubble_ratio,
        "split": [(o.overhead, o.dispatch, o.transport, o.propagated, o.producer_wait) for o in split],
        "cpu": (result.runtime_cpu, result.action_cpu),
        "names": sorted({e.name for e in events if e.is_compute}),
        "comm": sum(1 for e in events if e.kind == "comm"),
        "measured": measured_bubble_ratio(events),
        "simulated_measured_costs": simulate_measured(events, rt.schedule).bubble_ratio,
        "files": [os.path.join(out_dir, "zb-h1.json"), os.path.join(out_dir, "zb-h1.png")],
    }


def negative_check(world: int) -> dict:
    """Not trivially passing: the same comparison must reject a reference computed on perturbed targets."""
    model, stages = gpt_model(world, seed=0)
    ids, tgt = token_batch(4, seed=13)
    rt = build_runtime(stages, "zb-h1", n_microbatches=4, loss_fn=lm_loss, timeout=60)
    rt.step(ids, tgt)
    wrong = tgt.clone()
    wrong[0, 0] = (wrong[0, 0] + 1) % VOCAB
    _loss, ref = gpt_reference(model, ids.split(MB), wrong.split(MB))
    return compare(model, rt, ref)


def posting_order_check(world: int) -> list[tuple[str, int, int]]:
    """Every point-to-point op this rank posts in a zbv step, in posting order: ``(op, peer, tag)``."""
    log: list[tuple[str, int, int]] = []
    original = PipelineComm._launch

    def spy(self: PipelineComm, recv_ops: list, action) -> list:
        for op in [*self._state.queued, *recv_ops]:
            log.append(("send" if op.op is dist.isend else "recv", op.peer, op.tag))
        return original(self, recv_ops, action)

    PipelineComm._launch = spy
    try:
        _model, stages = gpt_model(2 * world, seed=1)
        rt = build_runtime(stages, "zbv", n_microbatches=4, loss_fn=lm_loss, timeout=60)
        rt.step(*token_batch(4, seed=14))
    finally:
        PipelineComm._launch = original
    return log


# -- failures ------------------------------------------------------------------------------------------


class _Explode(nn.Module):
    """Raises in its forward of the ``at``-th call (a rank that fails mid-step)."""

    def __init__(self, at: int) -> None:
        super().__init__()
        self.at, self.calls = at, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.at:
            raise ValueError(f"injected failure in forward call {self.calls}")
        return x


class _Stall(_Explode):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.at:
            import time

            time.sleep(60)
        return x


def failure_worker(rank: int, world: int, mode: str, failing_rank: int, timeout: float = 2.0) -> str:
    """1F1B on an MLP; ``failing_rank`` raises (``mode="raise"``) or stalls (``"stall"``) in its 2nd forward;
    ``timeout``: the runtime's bound on each wait."""
    torch.manual_seed(0)
    blocks = [nn.Linear(4, 4, dtype=torch.float64) for _ in range(world)]
    stages = [nn.Sequential(b) for b in blocks]
    if rank == failing_rank:
        stages[rank].append(_Explode(2) if mode == "raise" else _Stall(2))
    rt = build_runtime(stages, "1f1b", n_microbatches=4, loss_fn=F.mse_loss, timeout=timeout)
    x = torch.randn(8, 4, dtype=torch.float64)
    try:
        rt.step(x, x)
    except Exception:
        # A failed distributed step leaves receives posted: the runtime must refuse to run again.
        try:
            rt.step(x, x)
        except RuntimeError as again:
            if "a previous step failed" not in str(again):
                raise AssertionError(f"second step after a failure: {again}") from again
        else:
            raise AssertionError("a second step after a failed one was allowed") from None
        raise
    return "finished"


def scratch_dir() -> str:
    return tempfile.mkdtemp(prefix="splitgrad-pipeline-")
