"""splitgrad: split a layer's backward into input gradient now and weight gradient later.

Transformer Engine's names are kept (``delay_wgrad_compute``, ``backward_dw``, ``WeightGradStore``,
``register_wgrad_accumulation_and_reduce_hooks``, ``get_backward_dw_params``, ``main_grad``,
``skip_backward_post_hook``) so Megatron-style code ports unchanged.
"""

from __future__ import annotations

from .convert import convert
from .core import (
    SplitCapable,
    SplitModule,
    WeightGradStore,
    WgradBundle,
    WgradHooks,
    WgradTask,
    backward_dw,
    capture_wgrad,
    discard_wgrad,
    ensure_no_pending_wgrad,
    guard_optimizer,
    outstanding_wgrad,
    pending_wgrad,
    queued_wgrad,
    set_delay_wgrad_compute,
    split_modules,
)
from .graphs import GraphCaptureError, GraphedCallable, make_graphed_callables
from .module import GroupedLinear, LayerNormLinear, LayerNormMLP, Linear

__version__ = "0.1.0"

# Subpackages load on first use, so `import splitgrad` stays light (no torch.distributed, no matplotlib).
_SUBPACKAGES = ("graphs", "models", "ops", "parallel", "pipeline", "testing")


def __getattr__(name: str):
    if name in _SUBPACKAGES:
        import importlib

        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "GraphCaptureError",
    "GraphedCallable",
    "GroupedLinear",
    "LayerNormLinear",
    "LayerNormMLP",
    "Linear",
    "SplitCapable",
    "SplitModule",
    "WeightGradStore",
    "WgradBundle",
    "WgradHooks",
    "WgradTask",
    "__version__",
    "backward_dw",
    "capture_wgrad",
    "convert",
    "discard_wgrad",
    "ensure_no_pending_wgrad",
    "guard_optimizer",
    "make_graphed_callables",
    "outstanding_wgrad",
    "pending_wgrad",
    "queued_wgrad",
    "set_delay_wgrad_compute",
    "split_modules",
]
