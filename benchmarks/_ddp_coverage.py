"""When each bucket's gradients are ready, and how much of the reduction the compute after it could cover.

Used by ``bench_ddp.py``. :class:`ArrivalClock` records, through public hooks only, the time each parameter's
last gradient contribution of a step arrives (``register_post_accumulate_grad_hook`` for gradients that flow
through autograd, ``register_wgrad_accumulation_and_reduce_hooks`` for those a split module writes itself);
a bucket is ready when its last parameter is. :func:`coverable` turns those ready times into the most
reduction time the step's compute could hide.

**Coverable** (the bound the benchmark reports next to each variant's hidden fraction): the reduction of
bucket ``k`` cannot start before the bucket is ready (``ready[k]``, measured in a step without reduction,
from the start of backward) and cannot be hidden behind compute that is already over; and the buckets share
one link, so they are reduced one after another, in bucket order, each taking ``link[k]`` (the measured
reduction time alone, split over the buckets by bytes). Started as early as possible::

    finish[k] = max(ready[k], finish[k - 1]) + link[k]

the reductions end at ``finish[-1]``, while backward (+ ``backward_dw``) compute ends at ``end``: at least
``max(0, finish[-1] - end)`` stays exposed, so at most ``coverable = sum(link) - max(0, finish[-1] - end)``
can be hidden. A variant's ``hidden / coverable`` says how close it comes to what its launch points allow;
the coverable fraction itself says how good those launch points are (deferred wgrad makes every bucket
ready only during ``backward_dw``, after the whole dgrad pass, so its coverable is smaller).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from torch import nn

import splitgrad

__all__ = ["ArrivalClock", "coverable", "link_times", "torch_ddp_buckets"]


class ArrivalClock:
    """Per-parameter time of the latest gradient contribution, relative to :meth:`start`.

    Its hooks are registered after the DDP wrapper's, so in a step with reduction a bucket's time is just
    after our wrapper launched it (just before, for torch DDP, whose reducer hook runs after these).

    Args:
        model: the model whose parameters to watch (the wrapper's ``module``).
    """

    def __init__(self, model: nn.Module) -> None:
        self._t0 = time.perf_counter()
        self.arrived: dict[int, float] = {}
        #: End of the compute of the last step, set by :meth:`stop` (s from :meth:`start`).
        self.end = 0.0
        self._handles = []
        for p in model.parameters():
            if p.requires_grad:
                self._handles.append(p.register_post_accumulate_grad_hook(self._autograd_hook))
        seen: set[int] = set()
        for _, owner in splitgrad.split_modules(model):
            if id(owner.wgrad_store) in seen:
                continue
            seen.add(id(owner.wgrad_store))
            params = tuple(owner.get_backward_dw_params())
            self._handles.append(
                owner.register_wgrad_accumulation_and_reduce_hooks(lambda ps=params: self._mark(ps))
            )

    def _autograd_hook(self, p: torch.Tensor) -> None:
        # A parameter its module writes itself still passes AccumulateGrad (with nothing): not an arrival.
        if not getattr(p, "skip_backward_post_hook", False):
            self._mark((p,))

    def _mark(self, params: Sequence[torch.Tensor]) -> None:
        now = time.perf_counter() - self._t0
        for p in params:
            self.arrived[id(p)] = now

    def start(self) -> None:
        """Forget earlier arrivals; times are measured from now (call it right before backward)."""
        self.arrived.clear()
        self._t0 = time.perf_counter()

    def stop(self, *, at_last_arrival: bool = False) -> None:
        """Record the end of the compute (:attr:`end`): now, or when the last gradient arrived (for torch DDP,
        whose ``backward()`` itself waits for the reductions)."""
        self.end = max(self.arrived.values()) if at_last_arrival else time.perf_counter() - self._t0

    def ready_times(self, buckets: Sequence[Sequence[torch.Tensor]]) -> list[float]:
        """Per bucket (a list of its parameters), when its last parameter's gradient arrived (s)."""
        return [max(self.arrived.get(id(p), float("nan")) for p in params) for params in buckets]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def link_times(bucket_bytes: Sequence[int], reduce_alone: float) -> list[float]:
    """Split the measured time of reducing every bucket back to back over the buckets, by bytes (s)."""
    total = sum(bucket_bytes)
    return [reduce_alone * b / total for b in bucket_bytes]


def coverable(ready: Sequence[float], link: Sequence[float], end: float) -> tuple[float, list[float]]:
    """The most reduction time the compute could hide (the module docstring defines it).

    Args:
        ready: per bucket in launch order, when it becomes ready (s from the start of backward).
        link: per bucket, how long its reduction takes alone (s).
        end: when backward (and ``backward_dw``) compute ends (s from the start of backward).

    Returns:
        ``(coverable seconds, finish time of each bucket's reduction when started as early as possible)``.
    """
    finish: list[float] = []
    t = 0.0
    for r, c in zip(ready, link, strict=True):
        t = max(r, t) + c
        finish.append(t)
    exposed = max(0.0, (finish[-1] if finish else 0.0) - end)
    return sum(link) - exposed, finish


def torch_ddp_buckets(ddp: nn.parallel.DistributedDataParallel) -> list[list[nn.Parameter]]:
    """torch DDP's buckets (lists of parameters, in launch order), read from its logging data.

    torch reduces the first iteration in one bucket of everything, then rebuilds its buckets in the order the
    gradients arrived (first bucket 1 MiB, then ``bucket_cap_mb``) at the next forward; its logging data
    lists the rebuilt buckets' parameter indices. Call it after two training steps.

    Raises:
        RuntimeError: the buckets were not rebuilt yet.
    """
    data = ddp._get_ddp_logging_data()  # torch's own introspection, read only
    rebuilt = data.get("rebuilt_per_bucket_param_indices")
    if not rebuilt:
        raise RuntimeError(f"torch DDP has not rebuilt its buckets yet (run two steps first): {data}")
    params = [p for p in ddp.module.parameters() if p.requires_grad]
    return [[params[int(i)] for i in bucket.split()] for bucket in str(rebuilt).split(",")]
