"""The split contract (``splitgrad.core``): deferred weight-gradient work, the split-capable protocol, the base
class with its public extension points, and the whole-model helpers.

* :mod:`~splitgrad.core.store`: per-owner stores, hooks and the one account of owed work (``outstanding``);
* :mod:`~splitgrad.core.task`, :mod:`~splitgrad.core.bundle`: tasks run exactly once, capture bundles;
* :mod:`~splitgrad.core.contract`: :class:`SplitCapable`, :func:`is_split_capable`;
* :mod:`~splitgrad.core.split_module`, :mod:`~splitgrad.core.routing`: :class:`SplitModule` and where one
  backward sends each weight gradient;
* :mod:`~splitgrad.core.whole_model`: drain, count, guard, discard and switch over a module tree.

``__all__`` is what layer authors and consumers use. The pieces other splitgrad packages build on
(``store.WgradClaim``, ``bundle.active_bundle``, ``routing.wgrad_route``) are imported from their submodules.
"""

from __future__ import annotations

from .bundle import WgradBundle, capture_wgrad
from .contract import SplitCapable, is_split_capable
from .routing import split_backward
from .split_module import SplitModule
from .store import Outstanding, WeightGradStore, WgradHooks
from .task import WgradTask
from .whole_model import (
    backward_dw,
    discard_wgrad,
    ensure_no_pending_wgrad,
    guard_optimizer,
    outstanding_wgrad,
    pending_wgrad,
    queued_wgrad,
    set_delay_wgrad_compute,
    split_modules,
)

__all__ = [
    "Outstanding",
    "SplitCapable",
    "SplitModule",
    "WeightGradStore",
    "WgradBundle",
    "WgradHooks",
    "WgradTask",
    "backward_dw",
    "capture_wgrad",
    "discard_wgrad",
    "ensure_no_pending_wgrad",
    "guard_optimizer",
    "is_split_capable",
    "outstanding_wgrad",
    "pending_wgrad",
    "queued_wgrad",
    "set_delay_wgrad_compute",
    "split_backward",
    "split_modules",
]
