"""Batch-level overlap: one microbatch's forward runs while another's backward runs, each hiding the other's
all-to-alls (Megatron-Core's ``--overlap-moe-expert-parallel-comm``, DualPipe's overlapped chunk).

One thread, a fixed interleave at sub-layer granularity (``driver.py``): the forward runs as steps that
each end by issuing an exchange, and every backward exchange advances the forward by one step while it is in
flight. Every rank issues the same collectives in the same order, so forward and backward share one group.

Only the backward writes gradients, so they accumulate in the same order as running the parts one after the
other: training is bit-for-bit the same as in order.

With deferred wgrad, each MoE layer's expert weight gradients of the backward part run while that layer's
backward dispatch all-to-all is in flight (Megatron-Core's ``--delay-wgrad-compute`` placement), in the order
``backward_dw`` would have run them (see ``../dispatch_wgrad.py``); the dense layers' stay deferred.

A second driver, ``driver="threads"`` (the backward on a second thread, with a second process group per layer
for its exchanges and an optional compute baton), was retired: measured on 2 gloo ranks in a rate-limited
namespace, the single-thread driver hid more of the all-to-all time in every row (docs/expert_parallel.md).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import torch
from torch import nn

from ....core.steps import Steps, child_steps
from ..layer import ExpertParallelMoEMLP
from .driver import run_pair_in_steps

__all__ = ["OverlappedMoEStage", "overlapped_forward_backward", "set_wgrad_in_dispatch"]

logger = logging.getLogger(__name__)


def overlapped_forward_backward(
    module: nn.Module,
    x: Any,
    y: torch.Tensor,
    dy: torch.Tensor | None = None,
    *,
    wgrad_in_dispatch: bool | None = True,
    thread_stats: dict | None = None,
) -> Any:
    """Return ``module(x)`` while ``torch.autograd.backward(y, dy)`` runs interleaved with it on this thread.

    The backward runs first; each of its all-to-all exchanges, while in flight, advances the forward by one step
    (up to the forward's next exchange), and the forward's remaining steps run after the backward
    (Megatron-Core's combined-1F1B order; see ``driver.py``).

    Args:
        module: a model or pipeline stage holding expert-parallel layers, or its splitgrad data-parallel wrapper
            (e.g. :class:`~splitgrad.parallel.expert.ExpertDataParallel`; the pair then runs inside its
            ``no_sync()``: the backward part never starts a reduction).
        x: the forward part's input (e.g. ``ids: (batch, seq)`` or activations ``(batch, seq, hidden)``).
        y: the backward part's output (a loss or a stage output), from an earlier forward of ``module``.
        dy: its gradient, same shape as ``y`` (None for a scalar loss).
        wgrad_in_dispatch: for the call, set the ``wgrad_in_dispatch`` of ``module``'s expert layers: True runs
            each layer's deferred expert weight gradients (delayed wgrad only) while its backward dispatch
            all-to-all is in flight instead of leaving them to ``backward_dw`` / the bundle (skipped for a layer
            whose older deferred work is still owed elsewhere: it would change the accumulation order); None
            leaves the layers' own settings (:func:`set_wgrad_in_dispatch`; needed when ``y`` comes from
            another module, e.g. another pipeline stage).
        thread_stats: when given, filled with ``"forward"`` (``start`` / ``end``, ``cpu`` spent in its steps,
            ``steps``, ``in_backward``, ``num_threads``), ``"backward"`` (``start`` / ``end``, ``cpu`` without
            the forward steps run inside it, ``num_threads``) and ``"pair"`` (the whole call's span, CPU and,
            where the OS reports them, context switches); see
            :func:`~splitgrad.parallel.expert.overlap.driver.run_pair_in_steps`.

    Returns:
        ``module(x)``.

    Raises:
        ValueError: ``module`` is the bare model under a data-parallel wrapper (pass the wrapper).
        RuntimeError: a part raised (named, chained); each exchange wait is bounded by its group's timeout.
    """
    layers = {name: m for name, m in module.named_modules() if isinstance(m, ExpertParallelMoEMLP)}
    if not _is_data_parallel(module):
        wrapped = [name for name, p in module.named_parameters() if hasattr(p, "grad_added_to_main_grad")]
        if wrapped:
            raise ValueError(
                f"overlapped_forward_backward: {type(module).__name__}'s parameters {wrapped[:3]} are managed by a "
                "data-parallel wrapper (they carry grad_added_to_main_grad); pass the wrapper (e.g. the "
                "ExpertDataParallel) as module: it counts the forward part and keeps the backward part inside "
                "no_sync(), so no reduction starts from the backward part"
            )
    before = {name: m.wgrad_in_dispatch for name, m in layers.items()}
    for m in layers.values():
        m.wgrad_in_dispatch = m.wgrad_in_dispatch if wgrad_in_dispatch is None else wgrad_in_dispatch
    # Under a splitgrad data-parallel wrapper the backward part's wgrad hooks fire between the forward part's
    # steps, which issue all-to-alls and the aux-loss all-reduce (over the model's dp_group, often the
    # wrappers' group too): a bucket started from there would issue its collective in the middle of the
    # forward. The pair's backward is never the step's last microbatch (the forward part's microbatch is still
    # to come), so its contributions must only accumulate: the pair runs inside the wrapper's no_sync(), and
    # every bucket starts later, from the hooks of the last microbatch's B / W.
    sync_off = module.no_sync() if _is_data_parallel(module) else contextlib.nullcontext()
    try:
        with sync_off:
            return run_pair_in_steps(module, x, y, dy, thread_stats)
    finally:
        for name, m in layers.items():
            m.wgrad_in_dispatch = before[name]


def _is_data_parallel(module: nn.Module) -> bool:
    """A splitgrad data-parallel wrapper (``DistributedDataParallel``, ``ExpertDataParallel``): the same duck
    test as the pipeline runtime's."""
    return callable(getattr(module, "no_sync", None)) and callable(getattr(module, "finish_grad_sync", None))


class OverlappedMoEStage(nn.Module):
    """``module`` with an ``overlapped_forward_backward(x, y, dy)`` method (what the pipeline runtime calls for an
    overlapped ``F+B`` action, see ``docs/pipeline_runtime.md``). Shapes: as ``module``.

    Args:
        module: the stage.
        wgrad_in_dispatch: as :func:`overlapped_forward_backward`.
    """

    def __init__(self, module: nn.Module, *, wgrad_in_dispatch: bool | None = True) -> None:
        super().__init__()
        self.module = module
        self.wgrad_in_dispatch = wgrad_in_dispatch

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def forward_steps(self, *args: Any, **kwargs: Any) -> Steps:
        """:meth:`forward` as steps: the module's (see :mod:`splitgrad.core.steps`)."""
        return (yield from child_steps(self.module, *args, **kwargs))

    def overlapped_forward_backward(self, x: Any, y: torch.Tensor, dy: torch.Tensor | None = None) -> Any:
        """``self(x)`` while ``torch.autograd.backward(y, dy)`` runs (see :func:`overlapped_forward_backward`)."""
        return overlapped_forward_backward(self.module, x, y, dy, wgrad_in_dispatch=self.wgrad_in_dispatch)


def set_wgrad_in_dispatch(model: nn.Module, enabled: bool) -> int:
    """Turn ``wgrad_in_dispatch`` on or off for every expert-parallel MoE layer of ``model``.

    On, every backward of a layer (overlapped or not, plain ``loss.backward()`` or a pipeline ``B``/``BW``) runs
    the experts' deferred weight gradients inside its dispatch all-to-all; in a pipeline that moves the expert
    part of a ``W`` action into its ``B`` (the dense part stays in ``W``). Needed for pipeline pairs whose
    backward part is another stage than the forward part (``dualpipev``), which
    ``overlapped_forward_backward`` cannot see.

    Args:
        model: a model or stage holding :class:`~splitgrad.parallel.expert.ExpertParallelMoEMLP` layers.
        enabled: the new setting.

    Returns:
        The number of layers set.
    """
    layers = [m for m in model.modules() if isinstance(m, ExpertParallelMoEMLP)]
    for layer in layers:
        layer.wgrad_in_dispatch = bool(enabled)
    return len(layers)
