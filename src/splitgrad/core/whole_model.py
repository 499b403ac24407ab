"""Whole-model helpers: find, drain, count, guard and switch deferred wgrad work across a module tree.

TE leaves users to walk module trees by hand; these functions accept any ``nn.Module`` (a single splitgrad
layer, a model, a pipeline stage). A "split-capable" module is anything holding a ``wgrad_store``
(:class:`~splitgrad.store.WeightGradStore`) — modules and fusible ops alike.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .store import WeightGradStore

__all__ = [
    "backward_dw",
    "ensure_no_pending_wgrad",
    "guard_optimizer",
    "pending_wgrad",
    "set_delay_wgrad_compute",
    "split_modules",
]


def split_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """``(qualified_name, module)`` for every submodule (``model`` included) that owns a wgrad store."""
    for name, module in model.named_modules():
        if isinstance(getattr(module, "wgrad_store", None), WeightGradStore):
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


def pending_wgrad(model: nn.Module) -> int:
    """How many wgrad tasks wait in the stores of ``model``'s split-capable submodules.

    Tasks parked in :func:`~splitgrad.capture_wgrad` bundles are not counted here (run the bundles); they
    are counted by :func:`ensure_no_pending_wgrad`.
    """
    return sum(len(module.wgrad_store) for _, module in split_modules(model))


def ensure_no_pending_wgrad(model: nn.Module, *, what: str = "this point") -> None:
    """Raise ``RuntimeError`` listing every submodule whose weight gradient is still owed.

    Owed means queued in its store, captured in a bundle that has neither run nor been discarded, or held
    by a captured wgrad graph awaiting its replay (``WeightGradStore.owe``).
    """
    owed = []
    for name, m in split_modules(model):
        store = m.wgrad_store
        if len(store) or store.captured or store.owed_elsewhere:
            extra = f", in graphs={store.owed_elsewhere}" if store.owed_elsewhere else ""
            owed.append(f"{name} (pending={len(store)}, in bundles={store.captured}{extra})")
    if owed:
        raise RuntimeError(
            f"weight-gradient work is still pending at {what}; its gradients would be lost or stale. "
            f"Run splitgrad.backward_dw(model) or the capture bundles first. Owed by: {', '.join(owed)}"
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
