"""Checks run inside spawned gloo ranks: splitgrad layers under Megatron-Core's real DistributedDataParallel.

The wrapper is built as Megatron builds it, from a ``ProcessGroupCollection`` (no ``parallel_state``), on
CPU: its gradient buffers are allocated on ``torch.cuda.current_device()``, which these ranks patch to
return ``"cpu"`` — the only change to Megatron. Every gradient reaches ``main_grad`` through Megatron's own
hook (``_make_backward_post_hook``): on the AccumulateGrad node, or registered as the layers' wgrad hook.

Per configuration (layer mode x ``overlap_grad_reduce``, ``ddp_config.delay_wgrad_compute`` as Megatron sets
it from the same flag, plus fused layers under the other hook placement) two steps of two microbatches run,
the first microbatch under ``no_sync()``; the second step is the one where Megatron dispatches the
all-reduce from the hooks. After each step: ``main_grad`` equals plain float64 autograd over every rank's
microbatches (averaged, as Megatron scales by 1/dp), ``.grad`` is None everywhere, Megatron's hook fired once
per parameter per microbatch, and ``register_grad_ready`` (wrapped, the real method still runs) was called
once per parameter in the last microbatch and, with overlap, the buckets were already reducing before
``finish_grad_sync``. Fused steps allocate nothing weight-sized.
"""

from __future__ import annotations

import collections
import contextlib
import functools
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

import splitgrad
from splitgrad.integrations.megatron import check_ddp
from splitgrad.testing import AllocationTracker, assert_grads_close, main_grads, plain_autograd_grads
from tests.helpers import expect_error, run_named

F64 = torch.float64
N_MICROBATCHES = 2
TOKENS = 4
#: name -> (delay_wgrad_compute, fuse_wgrad_accumulation) of every splitgrad layer.
MODES = {
    "immediate": (False, False),
    "delayed": (True, False),
    "fused": (False, True),
    "delayed_fused": (True, True),
}


def build_model(delay: bool, fuse: bool) -> nn.Sequential:
    """Linear -> GELU -> LayerNormMLP, float64; the norm's parameters take autograd's path, the rest split."""
    torch.manual_seed(0)
    kw = {"delay_wgrad_compute": delay, "fuse_wgrad_accumulation": fuse, "params_dtype": F64}
    return nn.Sequential(splitgrad.Linear(16, 32, **kw), nn.GELU(), splitgrad.LayerNormMLP(32, 48, **kw))


def batches(rank: int, step: int) -> list[torch.Tensor]:
    """This rank's microbatches of ``step``: ``(TOKENS, 16)`` each."""
    g = torch.Generator().manual_seed(1000 * step + 10 * rank)
    return [torch.randn(TOKENS, 16, dtype=F64, generator=g) for _ in range(N_MICROBATCHES)]


def reference(world: int, step: int, delay: bool, fuse: bool) -> dict[str, torch.Tensor]:
    """Plain float64 autograd over every rank's microbatches, divided by the data-parallel size."""

    def loss(model: nn.Module) -> torch.Tensor:
        total = sum(model(x).square().mean() for r in range(world) for x in batches(r, step))
        return total / world

    return plain_autograd_grads(build_model(delay, fuse), loss)


@contextlib.contextmanager
def counted_hooks() -> Iterator[list[nn.Parameter]]:
    """While Megatron's DDP is built inside the block, every hook it makes records its parameter when fired."""
    from megatron.core.distributed import DistributedDataParallel

    original = DistributedDataParallel._make_backward_post_hook
    fired: list[nn.Parameter] = []

    def make(self, param):
        hook = original(self, param)

        def counted(*args):
            fired.append(param)
            return hook(*args)

        return counted

    DistributedDataParallel._make_backward_post_hook = make
    try:
        yield fired
    finally:
        DistributedDataParallel._make_backward_post_hook = original


def megatron_ddp(
    model: nn.Module, groups: list, *, overlap: bool, delay: bool, bucket_size: int | None = 2048
):
    """Megatron's ``DistributedDataParallel`` over the world group (tp = pp = ep = this rank alone)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.transformer_config import TransformerConfig

    pg = ProcessGroupCollection()
    pg.dp = pg.dp_cp = dist.group.WORLD
    pg.tp = pg.pp = pg.ep = pg.expt_dp = groups[dist.get_rank()]
    config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=1)
    ddp_config = DistributedDataParallelConfig(
        overlap_grad_reduce=overlap, delay_wgrad_compute=delay, bucket_size=bucket_size
    )
    return DistributedDataParallel(config, ddp_config, model, pg_collection=pg)


def count_ready(ddp) -> list[tuple[nn.Parameter, bool]]:
    """Wrap each bucket group's real ``register_grad_ready``: record ``(param, is_last_microbatch)`` per call."""
    calls: list[tuple[nn.Parameter, bool]] = []
    for group in ddp.bucket_groups:
        real = group.register_grad_ready

        def counted(param, force_all_reduce=False, real=real, group=group):
            calls.append((param, group.is_last_microbatch))
            return real(param, force_all_reduce)

        group.register_grad_ready = counted
    return calls


def run_w(model: nn.Module) -> None:
    """One microbatch's W: each split layer's oldest task (backward order), as ``backward_dw`` per layer."""
    for _, m in reversed(list(splitgrad.split_modules(model))):
        m.backward_dw()


def run_step(ddp, model: nn.Module, xs: list[torch.Tensor], *, deferred: bool, grouped: bool) -> list[bool]:
    """One step; returns, per bucket group, whether its reduction was already issued before finish_grad_sync.

    ``grouped``: both backwards, then both W's (a pipeline's I I W W), the first W inside ``no_sync()``.
    """
    ddp.zero_grad_buffer()
    last = len(xs) - 1
    if grouped:
        with ddp.no_sync():
            ddp(xs[0]).square().mean().backward()
        ddp(xs[1]).square().mean().backward()
        with ddp.no_sync():
            run_w(model)
        run_w(model)
    else:
        for i, x in enumerate(xs):
            with ddp.no_sync() if i < last else contextlib.nullcontext():
                ddp(x).square().mean().backward()
                if deferred:
                    run_w(model)
    issued = [g.grad_reduce_handle is not None for g in ddp.bucket_groups]
    ddp.finish_grad_sync()
    return issued


def check_config(
    rank: int, world: int, groups: list, mode: str, overlap: bool, ddp_delay: bool, grouped: bool
):
    delay, fuse = MODES[mode]
    model = build_model(delay, fuse)
    with counted_hooks() as fired:
        ddp = megatron_ddp(model, groups, overlap=overlap, delay=ddp_delay)
    check_ddp(ddp)
    ready = count_ready(ddp)
    params = dict(ddp.module.named_parameters())
    fused_bytes = min(p.numel() * p.element_size() for p in params.values() if p.dim() == 2)
    what = f"{mode} overlap={overlap} ddp_delay={ddp_delay} grouped={grouped} rank {rank}"
    for step in range(2):
        fired.clear()
        ready.clear()
        tracker = AllocationTracker() if fuse else contextlib.nullcontext()
        with tracker:
            issued = run_step(ddp, model, batches(rank, step), deferred=delay, grouped=grouped)
        got = main_grads(ddp.module)
        want = reference(world, step, delay, fuse)
        assert_grads_close(got, want, rtol=1e-12, atol=1e-14, what=f"{what} step {step}")
        left = [n for n, p in params.items() if p.grad is not None]
        assert not left, f"{what}: .grad left on {left}"
        per_param = collections.Counter(id(p) for p in fired)
        wrong = {n: per_param[id(p)] for n, p in params.items() if per_param[id(p)] != N_MICROBATCHES}
        assert not wrong, f"{what}: Megatron's hook fired {wrong} times, expected {N_MICROBATCHES} each"
        if overlap:
            last = collections.Counter(id(p) for p, is_last in ready if is_last)
            wrong = {n: last[id(p)] for n, p in params.items() if last[id(p)] != 1}
            assert not wrong, f"{what}: register_grad_ready in the last microbatch {wrong}, expected 1 each"
            assert len(ready) == N_MICROBATCHES * len(params), (
                f"{what}: {len(ready)} register_grad_ready calls"
            )
            if step > 0:  # Megatron issues from the hooks once the first batch recorded the expected counts
                assert all(issued), f"{what}: buckets not reducing before finish_grad_sync: {issued}"
        else:
            assert not ready, f"{what}: register_grad_ready called without overlap_grad_reduce"
        if fuse:
            big = [a for a in tracker.allocations if a[1] >= fused_bytes]
            assert not big, f"{what}: weight-sized allocations {big} (weights >= {fused_bytes} bytes)"


def check_wrong_reference_is_rejected(rank: int, world: int, groups: list) -> None:
    """The comparison is not trivially passing: a reference missing one microbatch is refused."""
    model = build_model(*MODES["delayed_fused"])
    ddp = megatron_ddp(model, groups, overlap=True, delay=True)
    run_step(ddp, model, batches(rank, 0), deferred=True, grouped=False)
    want = reference(world, 0, *MODES["delayed_fused"])
    first = next(iter(want))
    want[first] = want[first] * (1 - 1e-9)
    got = main_grads(ddp.module)
    expect_error(
        AssertionError,
        "perturbed",
        lambda: assert_grads_close(got, want, rtol=1e-12, atol=1e-14, what="perturbed"),
    )


def check_late_hooks_refused(rank: int, world: int, groups: list) -> None:
    """``check_ddp`` refuses delayed layers under ``delay_wgrad_compute=False``, and that layout does lose the
    deferred gradients (Megatron's hook ran before ``backward_dw`` wrote them)."""
    model = build_model(*MODES["delayed"])
    ddp = megatron_ddp(model, groups, overlap=False, delay=False)
    expect_error(ValueError, "delay_wgrad_compute=True", lambda: check_ddp(ddp))
    run_step(ddp, model, batches(rank, 0), deferred=True, grouped=False)
    got, want = main_grads(ddp.module), reference(world, 0, *MODES["delayed"])
    lost = [n for n in want if n.endswith("weight") and not torch.allclose(got[n], want[n])]
    assert lost, "the refused layout reduced every deferred gradient after all"
    for p in ddp.module.parameters():
        p.grad = None  # what it left behind


def check_nested_hooks_refused(rank: int, world: int, groups: list) -> None:
    """``check_ddp`` refuses ``ops.Sequential`` around a split op (a container forwarding the hook
    registration to its members: Megatron registers on both), and Megatron's own assertion shows why: the
    second firing finds no gradient."""
    torch.manual_seed(0)
    model = splitgrad.ops.Sequential(
        splitgrad.ops.BasicLinear(16, 8, delay_wgrad_compute=True, accumulate_into_main_grad=True, dtype=F64)
    )
    ddp = megatron_ddp(model, groups, overlap=True, delay=True)
    expect_error(ValueError, "0.weight", lambda: check_ddp(ddp))
    ddp.zero_grad_buffer()
    ddp(batches(rank, 0)[0]).square().mean().backward()
    expect_error(AssertionError, "param.grad being None", lambda: splitgrad.backward_dw(model))
    splitgrad.discard_wgrad(model)


def _configs() -> dict[str, Callable[[int, int, list], None]]:
    table: dict[str, Callable[[int, int, list], None]] = {}
    for mode, (delay, _) in MODES.items():
        for overlap in (False, True):
            table[f"{mode}_overlap{int(overlap)}"] = functools.partial(
                check_config, mode=mode, overlap=overlap, ddp_delay=delay, grouped=False
            )
    for overlap in (False, True):  # fused without delay, hooked as the layers' wgrad hook instead
        table[f"fused_wgradhook_overlap{int(overlap)}"] = functools.partial(
            check_config, mode="fused", overlap=overlap, ddp_delay=True, grouped=False
        )
    for mode in ("delayed", "delayed_fused"):  # I I W W, as pipelines run it
        table[f"{mode}_grouped_overlap1"] = functools.partial(
            check_config, mode=mode, overlap=True, ddp_delay=True, grouped=True
        )
    table["wrong_reference_is_rejected"] = check_wrong_reference_is_rejected
    table["late_hooks_refused"] = check_late_hooks_refused
    table["nested_hooks_refused"] = check_nested_hooks_refused
    return table


CHECKS = _configs()
ALL = list(CHECKS)


def run_checks(rank: int, world: int, names: list[str]) -> dict[str, str | None]:
    """Entry point of every rank: patch Megatron's one CUDA call, then run the named checks."""
    torch.cuda.current_device = lambda: "cpu"  # Megatron's grad buffers: torch.zeros(..., device=this)
    groups = [dist.new_group([r]) for r in range(world)]  # collective: every rank creates every group
    return run_named({n: functools.partial(CHECKS[n], rank, world, groups) for n in names}, names)
