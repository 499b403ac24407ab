"""A safe optimizer step for a pipeline: global gradient-norm clipping and a NaN/inf skip, exact across ranks.

Clipping needs the norm of the *whole* model's gradient and the NaN/inf check needs every rank's verdict, but a
pipeline rank holds a few stages. :class:`SafeStep` sums, in one all-reduce over every rank of the job once
the step's schedule is done (nothing synchronises the ranks in the middle of the schedule), each rank's
float64 sum of squared gradients and its count of non-finite gradients. Every parameter is counted once: a
data-parallel replica counts its dense parameters only on the first rank of ``dp_group``, an expert shard
(``param.expert_parallel``) only on the first rank of ``expert_dp_group``. Every rank then takes the same
decision: skip the step (optimizer state untouched), scale every gradient by ``max_norm / (norm + 1e-6)``
when the norm exceeds ``max_norm`` (torch's ``clip_grad_norm_``), or step as is.

With ``post_validate=True`` (the zero-bubble paper's "optimizer post-validation") a rank does not wait for the
global verdict before stepping: it starts the reduction, steps speculatively on the unclipped gradient, and
then checks the verdict; if the step had to be skipped or clipped, it restores the parameters and optimizer
state it saved before (exact copies) and does what the synchronous version does. A rank whose own gradient
already decides the matter (non-finite, or a local norm above ``max_norm``) does not speculate. The result is
bitwise the synchronous one; the cost is a copy of the parameters and optimizer state per step.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..distributed.group_ref import GroupRef
from ..distributed.wait import bounded_wait

__all__ = ["SafeStep", "StepReport"]

logger = logging.getLogger(__name__)

_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s


@dataclass(kw_only=True, slots=True)
class StepReport:
    """What one :meth:`SafeStep.step` did (the same on every rank)."""

    norm: float
    """The global gradient norm (L2, float64); ``inf``/``nan`` when a gradient was not finite."""
    skipped: bool
    """A gradient was not finite somewhere: no parameter or optimizer state changed."""
    clip_coef: float
    """The factor every gradient was scaled by (1.0: not clipped)."""
    rolled_back: bool
    """With ``post_validate``: this rank stepped speculatively and had to undo it."""


class SafeStep:
    """``optimizer.step()`` with global gradient-norm clipping and a NaN/inf skip over every rank.

    Call :meth:`step` on every rank of the job after ``PipelineRuntime.step`` returned, instead of
    ``optimizer.step()``::

        safe = SafeStep(optimizer, max_norm=1.0, dp_group=groups.dp_group)
        for ids, targets in batches:
            runtime.zero_grad()
            runtime.step(ids, targets)
            report = safe.step()          # report.norm, report.skipped, report.clip_coef

    The gradient of a parameter is its ``main_grad`` when it has one (the data-parallel average, e.g.
    :class:`splitgrad.parallel.DistributedDataParallel`'s), else its ``.grad``; clipping scales both when
    they are distinct tensors. The optimizer must not modify gradients itself (torch's optimizers do not).

    Args:
        optimizer: this rank's optimizer.
        max_norm: clip to this global L2 norm; None: no clipping (the NaN/inf skip only).
        skip_nonfinite: skip the step when any gradient anywhere holds a NaN or an infinity.
        group: every rank of the job, the group the partial sums are reduced over (None: the default group).
        dp_group: the ranks holding replicas of this rank's dense parameters (data parallelism; with expert
            parallelism, the dense parameters' data-parallel group); None: not replicated.
        expert_dp_group: the ranks holding replicas of this rank's experts (parameters marked
            ``expert_parallel``; ``ExpertDataParallel``'s ``expert_dp_group``); None: not replicated.
        post_validate: step speculatively before the global verdict arrives, undo when it fails.
        timeout: seconds the reduction may take before a ``RuntimeError`` naming it.

    Raises:
        ValueError: ``max_norm`` or ``timeout`` not positive.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        max_norm: float | None = None,
        skip_nonfinite: bool = True,
        group: dist.ProcessGroup | None = None,
        dp_group: dist.ProcessGroup | None = None,
        expert_dp_group: dist.ProcessGroup | None = None,
        post_validate: bool = False,
        timeout: float = 300.0,
    ) -> None:
        if max_norm is not None and not max_norm > 0:
            raise ValueError(f"SafeStep: max_norm must be positive or None, got {max_norm=}")
        if not timeout > 0:
            raise ValueError(f"SafeStep: timeout must be positive seconds, got {timeout=}")
        self.optimizer, self.max_norm, self.skip_nonfinite = optimizer, max_norm, skip_nonfinite
        self.post_validate, self.timeout = post_validate, float(timeout)
        self._distributed = dist.is_available() and dist.is_initialized()
        self._group = GroupRef(group, owner="SafeStep.group") if self._distributed else None
        # Whether this rank counts its dense / expert parameters: the first of their replicas does.
        self._counts = (_first(dp_group), _first(expert_dp_group))

    def step(self) -> StepReport:
        """Check, clip and step (every rank; see the class docstring). Returns what was done."""
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        grads = [g for p in params for g in _grads(p)]
        partial = self._local_partial(params)
        speculate = self.post_validate and not self._decided_locally(partial)
        pending = self._reduce(partial)  # in place, in flight until wait_done()
        snapshot = _Snapshot(self.optimizer, params) if speculate else None
        if snapshot is not None:
            self.optimizer.step()
        pending.wait_done()
        norm = math.sqrt(float(partial[0]))
        skip = self.skip_nonfinite and (bool(partial[1] > 0) or not math.isfinite(norm))
        coef = 1.0 if skip or self.max_norm is None else min(1.0, self.max_norm / (norm + _EPS))
        if snapshot is not None:
            if not skip and coef == 1.0:
                return StepReport(norm=norm, skipped=False, clip_coef=1.0, rolled_back=False)
            snapshot.restore()
        if skip:
            logger.warning("SafeStep: non-finite gradient (global norm %s): step skipped", norm)
        else:
            if coef < 1.0:
                for g in grads:
                    g.mul_(coef)
            self.optimizer.step()
        return StepReport(norm=norm, skipped=skip, clip_coef=coef, rolled_back=snapshot is not None)

    def _local_partial(self, params: list[torch.Tensor]) -> torch.Tensor:
        """``[sum of squares of the gradients this rank counts, its non-finite gradients]``, float64 (a square
        sum that overflows float64 counts as non-finite too; every rank counts its non-finite gradients)."""
        squares = [
            (
                self._counts[bool(getattr(p, "expert_parallel", False))],
                g[0].detach().to(torch.float64).square().sum(),
            )
            for p in params
            if (g := _grads(p))
        ]
        device = squares[0][1].device if squares else torch.device("cpu")
        total, bad = (torch.zeros((), dtype=torch.float64, device=device) for _ in range(2))
        for counted, sq in squares:  # in the optimizer's order: the same additions on every run
            if counted:
                total += sq
            bad += (~torch.isfinite(sq)).to(torch.float64)
        return torch.stack([total, bad])

    def _decided_locally(self, partial: torch.Tensor) -> bool:
        """This rank's own gradient already fixes the verdict (not finite, or above ``max_norm`` alone)."""
        if float(partial[1]) > 0 or not math.isfinite(float(partial[0])):
            return True
        return self.max_norm is not None and float(partial[0]) > self.max_norm**2

    def _reduce(self, partial: torch.Tensor) -> _Reduction:
        if not self._distributed:
            return _Reduction(None, self.timeout, None)
        group = self._group.get_or_none()
        return _Reduction(dist.all_reduce(partial, group=group, async_op=True), self.timeout, group)


def _first(group: dist.ProcessGroup | None) -> bool:
    """Whether this rank is the first of ``group`` (True without one)."""
    return group is None or dist.get_rank(group) == 0


class _Reduction:
    """The partial sums' all-reduce in flight, waited for with a bound (and an error naming it)."""

    __slots__ = ("group", "timeout", "work")

    def __init__(self, work: dist.Work | None, timeout: float, group: dist.ProcessGroup | None) -> None:
        self.work, self.timeout, self.group = work, timeout, group

    def wait_done(self) -> None:
        if self.work is not None:
            what = "SafeStep: all-reduce of the gradient norm and non-finite count"
            bounded_wait(self.work, what, timeout=self.timeout, group=self.group)


def _grads(p: torch.Tensor) -> list[torch.Tensor]:
    """The gradients to read and scale: ``main_grad`` (when present) first, then a distinct ``.grad``."""
    main = getattr(p, "main_grad", None)
    grad = p.grad
    if main is None:
        return [] if grad is None else [grad]
    if grad is None or _same_memory(grad, main):
        return [main]
    return [main, grad]


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.dtype == b.dtype and a.shape == b.shape


class _Snapshot:
    """Exact copies of the parameters and optimizer state, to undo a speculative step."""

    __slots__ = ("optimizer", "params", "state")

    def __init__(self, optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> None:
        self.optimizer = optimizer
        self.params = [(p, p.detach().clone()) for p in params]
        self.state = {
            p: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in optimizer.state[p].items()}
            for p in params
            if p in optimizer.state
        }

    def restore(self) -> None:
        with torch.no_grad():
            for p, saved in self.params:
                p.copy_(saved)
        for p in [p for p in self.optimizer.state if p not in self.state]:  # created by the step
            del self.optimizer.state[p]
        for p, state in self.state.items():
            self.optimizer.state[p] = state
