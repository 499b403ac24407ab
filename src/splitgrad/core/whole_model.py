"""Whole-model helpers: find, drain, count, guard and switch deferred wgrad work across a module tree.

TE leaves users to walk module trees by hand; these functions accept any ``nn.Module`` (a single splitgrad
layer, a model, a pipeline stage). A "split-capable" module is anything honouring
:class:`~splitgrad.core.contract.SplitCapable` — modules and fusible ops alike.

Owed work is counted once, by each layer's store (:attr:`~splitgrad.core.store.WeightGradStore.outstanding`):
queued, held by capture bundles, or waiting for a wgrad-graph replay.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .contract import is_split_capable
from .store import Outstanding, WeightGradStore

__all__ = [
    "backward_dw",
    "discard_wgrad",
    "ensure_no_pending_wgrad",
    "guard_optimizer",
    "outstanding_wgrad",
    "pending_wgrad",
    "queued_wgrad",
    "set_delay_wgrad_compute",
    "split_modules",
]

logger = logging.getLogger(__name__)


def split_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """``(qualified_name, module)`` for every split-capable submodule (``model`` included)."""
    for name, module in model.named_modules():
        if is_split_capable(module):
            yield name or type(module).__name__, module


def backward_dw(model: nn.Module) -> int:
    """Run every pending wgrad task of every split-capable submodule; returns how many ran.

    Modules are drained in reverse registration order (roughly backprop order, so a data-parallel wrapper's
    buckets complete in the order it laid them out); each module's own tasks run oldest first.
    """
    ran = 0
    for _, module in reversed(list(split_modules(model))):
        store: WeightGradStore = module.wgrad_store
        while len(store):
            store.run_next()
            ran += 1
    return ran


def outstanding_wgrad(model: nn.Module) -> Outstanding:
    """Everything ``model``'s split-capable submodules are owed: queued, in bundles, in graph replays."""
    total = Outstanding()
    for _, module in split_modules(model):
        total = total + module.wgrad_store.outstanding
    return total


def pending_wgrad(model: nn.Module) -> int:
    """How many wgrad tasks ``model`` still owes, wherever they sit (``outstanding_wgrad(model).total``).

    Counts the stores' queues, :func:`~splitgrad.capture_wgrad` bundles that neither ran nor were discarded,
    and captured wgrad graphs awaiting their replay. :func:`queued_wgrad` counts the queues only.
    """
    return outstanding_wgrad(model).total


def queued_wgrad(model: nn.Module) -> int:
    """How many tasks wait in the stores' FIFO queues (TE's meaning: what ``backward_dw`` would run)."""
    return sum(len(module.wgrad_store) for _, module in split_modules(model))


def discard_wgrad(model: nn.Module) -> int:
    """Drop every *queued* wgrad task of ``model`` without running it (their gradients are lost, on purpose).

    The way out after a bundle was garbage collected unrun (its tasks were moved to the queues) when you do
    not want those gradients. Bundles you still hold are discarded with ``bundle.discard()``.

    Returns:
        How many tasks were dropped.
    """
    dropped = sum(module.wgrad_store.clear() for _, module in split_modules(model))
    if dropped:
        logger.warning("discard_wgrad: dropped %d queued wgrad task(s) of %s", dropped, type(model).__name__)
    return dropped


def ensure_no_pending_wgrad(model: nn.Module, *, what: str = "this point") -> None:
    """Raise ``RuntimeError`` listing every submodule whose weight gradient is still owed.

    Owed means queued in its store, captured in a bundle that has neither run nor been discarded, or held
    by a captured wgrad graph awaiting its replay (``WeightGradStore.owe``).
    """
    owed = []
    for name, m in split_modules(model):
        out = m.wgrad_store.outstanding
        if out:
            extra = f", in graphs={out.in_graphs}" if out.in_graphs else ""
            owed.append(f"{name} (pending={out.queued}, in bundles={out.in_bundles}{extra})")
    if owed:
        raise RuntimeError(
            f"weight-gradient work is still pending at {what}; its gradients would be lost or stale. "
            "Run splitgrad.backward_dw(model) or the capture bundles first (or give the work up on purpose: "
            f"bundle.discard(), splitgrad.discard_wgrad(model)). Owed by: {', '.join(owed)}"
        )


def guard_optimizer(optimizer: torch.optim.Optimizer, model: nn.Module) -> RemovableHandle:
    """Make ``optimizer.step()`` fail loudly while any wgrad work of ``model`` is pending.

    Returns:
        The step pre-hook's handle; ``handle.remove()`` lifts the guard.
    """
    label = f"{type(optimizer).__name__}.step()"

    def check(_optimizer, _args, _kwargs) -> None:
        ensure_no_pending_wgrad(model, what=label)

    return optimizer.register_step_pre_hook(check)


def set_delay_wgrad_compute(model: nn.Module, enabled: bool) -> int:
    """Switch deferral on every split-capable submodule (keeping ``skip_backward_post_hook`` consistent).

    Returns:
        How many modules were switched.
    """
    modules = [m for _, m in split_modules(model)]
    for module in modules:
        module.set_delay_wgrad_compute(enabled)
    return len(modules)
