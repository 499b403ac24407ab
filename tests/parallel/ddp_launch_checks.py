"""When buckets launch: as soon as they are complete, never later (run inside spawned ranks by ddp_checks).

Why: overlap is the point of the wrapper. The gradient checks prove the averages are right whenever the
buckets launch; these prove each bucket's collective is issued at the earliest moment the bucket order
allows — right after the hook that completed it, in backward (immediate, fused) or in ``backward_dw``
(deferred) — and that ``backward_dw`` runs the W tasks so that buckets complete front to back, one after the
other, the first one after its own W only.
"""

from __future__ import annotations

import torch
from torch import nn

import splitgrad
from splitgrad.parallel import DistributedDataParallel as DDP
from splitgrad.testing import assert_grads_close, main_grads, shard
from tests.parallel.ddp_models import batch, deep_model, loss_of, mixed_model, reference


class LaunchRecorder:
    """After every contribution (hooks registered after the wrapper's), which buckets had launched."""

    def __init__(self, ddp: DDP) -> None:
        self.ddp = ddp
        self.bucket_of = {id(p): b.index for b in ddp.buckets for p in b.params}
        #: (buckets of the parameters that just arrived, how many buckets had launched right after).
        self.events: list[tuple[tuple[int, ...], int]] = []
        for p in ddp.module.parameters():
            p.register_post_accumulate_grad_hook(self._autograd)
        for _, owner in splitgrad.split_modules(ddp.module):
            params = tuple(owner.get_backward_dw_params())
            owner.register_wgrad_accumulation_and_reduce_hooks(lambda ps=params: self._record(ps))

    def _autograd(self, p: torch.Tensor) -> None:
        if not getattr(p, "skip_backward_post_hook", False):
            self._record((p,))

    def _record(self, params: tuple[torch.Tensor, ...]) -> None:
        self.events.append((tuple(self.bucket_of[id(p)] for p in params), len(self.ddp.launch_order)))

    def late_or_early(self) -> list[str]:
        """Events after which the launched count differs from the complete leading buckets (one contribution
        per parameter per step in these models, so a bucket is complete once all its parameters arrived)."""
        missing = [len(b.params) for b in self.ddp.buckets]
        wrong = []
        for i, (buckets, launched) in enumerate(self.events):
            for b in buckets:
                missing[b] -= 1
            ready = 0
            while ready < len(missing) and missing[ready] == 0:
                ready += 1
            if launched != ready:
                wrong.append(
                    f"after contribution {i} (buckets {buckets}): {launched} launched, {ready} ready"
                )
        return wrong


def _step(rank: int, world: int, model: nn.Module, **ddp_kw) -> tuple[DDP, LaunchRecorder]:
    ddp = DDP(model, grad_reduce_dtype=None, **ddp_kw)
    recorder = LaunchRecorder(ddp)
    loss_of(ddp(shard(batch(), rank, world))).backward()
    splitgrad.backward_dw(ddp)
    return ddp, recorder


def check_buckets_launch_when_ready(rank: int, world: int) -> None:
    """Immediate/deferred x fused/unfused: each bucket launches right after the hook that completed it."""
    ref = reference()
    for delay in (False, True):
        for fused in (False, True):
            what = f"{delay=} {fused=}"
            model = mixed_model(delay, fused)
            ddp, recorder = _step(rank, world, model, bucket_size=300)
            if len(ddp.buckets) < 3:
                raise AssertionError(f"{what}: expected several buckets, got {len(ddp.buckets)}")
            wrong = recorder.late_or_early()
            if wrong:
                raise AssertionError(f"{what}: buckets not launched when ready: {wrong}")
            ddp.finish_grad_sync()
            assert_grads_close(main_grads(model), ref, what=what)
    # Not trivially passing: with overlap off every bucket is ready long before it launches.
    _, recorder = _step(rank, world, mixed_model(True, False), bucket_size=300, overlap_grad_reduce=False)
    if not recorder.late_or_early():
        raise AssertionError("overlap_grad_reduce=False: the recorder saw no late launch")
    recorder.ddp.finish_grad_sync()


def check_backward_dw_completes_buckets_front_to_back(rank: int, world: int) -> None:
    """Deferred: ``backward_dw`` runs W in reverse registration order, so buckets (laid out in backprop
    order) complete one after the other and the first launches after its own layer's W only."""
    for fused in (False, True):
        model = deep_model(True, fused)  # 4 layers
        ddp, recorder = _step(rank, world, model, bucket_size=1)
        n = len(ddp.buckets)
        if n != 8:  # weight and bias apart: bucket_size=1 closes a bucket after every parameter
            raise AssertionError(f"{fused=}: expected 8 one-parameter buckets, got {n}")
        order = [b for buckets, _ in recorder.events for b in sorted(buckets)]
        if order != sorted(order):
            raise AssertionError(f"{fused=}: W completed buckets out of layout order: {order}")
        first_launch = next(i for i, (_, launched) in enumerate(recorder.events) if launched)
        if first_launch != 0:
            raise AssertionError(f"{fused=}: the first bucket launched only after W number {first_launch}")
        wrong = recorder.late_or_early()
        if wrong:
            raise AssertionError(f"{fused=}: {wrong}")
        ddp.finish_grad_sync()
        if ddp.last_launched_early != n:
            raise AssertionError(f"{fused=}: {ddp.last_launched_early}/{n} launched before finish")
