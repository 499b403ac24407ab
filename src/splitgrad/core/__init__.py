"""The split contract: deferred weight-gradient work, the split-capable base class, whole-model helpers."""

from __future__ import annotations

from .split_module import SplitModule
from .store import WeightGradStore, WgradBundle, WgradHooks, WgradTask, active_bundle, capture_wgrad
from .whole_model import (
    backward_dw,
    ensure_no_pending_wgrad,
    guard_optimizer,
    pending_wgrad,
    set_delay_wgrad_compute,
    split_modules,
)

__all__ = [
    "SplitModule",
    "WeightGradStore",
    "WgradBundle",
    "WgradHooks",
    "WgradTask",
    "active_bundle",
    "backward_dw",
    "capture_wgrad",
    "ensure_no_pending_wgrad",
    "guard_optimizer",
    "pending_wgrad",
    "set_delay_wgrad_compute",
    "split_modules",
]
