"""splitgrad: split a layer's backward into input gradient now and weight gradient later.

Transformer Engine's names are kept (``delay_wgrad_compute``, ``backward_dw``, ``WeightGradStore``,
``register_wgrad_accumulation_and_reduce_hooks``, ``get_backward_dw_params``, ``main_grad``,
``skip_backward_post_hook``) so Megatron-style code ports unchanged.
"""

from __future__ import annotations

import contextlib as _contextlib
import importlib as _importlib
from typing import TYPE_CHECKING

import torch.distributed as _dist

from .convert import convert
from .core import (
    SplitCapable,
    SplitModule,
    WeightGradStore,
    WgradBundle,
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
from .module import GroupedLinear, LayerNormLinear, LayerNormMLP, Linear

# torch.distributed.nn.functional binds the default process group *as it is at import* into its functions'
# default arguments (`group=group.WORLD`). Imported after init_process_group (torch._dynamo pulls it in, e.g.
# through the first torch.optim optimizer), that keeps the group, and its gloo worker threads, alive past
# destroy_process_group(), where gloo can abort a finished rank at exit (docs/parallel.md, "A crash at exit").
# splitgrad is usually imported before the group exists: importing it then binds None (about 4 ms of CPU).
if _dist.is_available() and not _dist.is_initialized():
    with _contextlib.suppress(ImportError):
        _importlib.import_module("torch.distributed.nn.functional")

if TYPE_CHECKING:  # type checkers and IDEs see the lazy names below as ordinary imports
    # Subpackages, loaded on first attribute access (the redundant aliases mark them as re-exports).
    from . import graphs as graphs
    from . import integrations as integrations
    from . import models as models
    from . import ops as ops
    from . import parallel as parallel
    from . import pipeline as pipeline
    from . import testing as testing
    from .graphs import GraphCaptureError, GraphedCallable, make_graphed_callables

__version__ = "0.1.0"

# Subpackages load on first use, so `import splitgrad` stays light: only the core and the modules load, and
# none of the subpackages (tests/core/test_lazy_imports.py checks it in a fresh interpreter). torch itself
# imports torch.distributed and numpy (when installed), so those cannot be avoided here.
_SUBPACKAGES = ("graphs", "integrations", "models", "ops", "parallel", "pipeline", "testing")
# Top-level names that live in a subpackage, resolved (and cached) on first access.
_LAZY_NAMES = {
    "GraphCaptureError": "graphs",
    "GraphedCallable": "graphs",
    "make_graphed_callables": "graphs",
}


def __getattr__(name: str) -> object:
    import importlib

    if name in _SUBPACKAGES:
        return importlib.import_module(f"{__name__}.{name}")
    if name in _LAZY_NAMES:
        value = getattr(importlib.import_module(f"{__name__}.{_LAZY_NAMES[name]}"), name)
        globals()[name] = value  # later lookups skip __getattr__
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_SUBPACKAGES) | set(_LAZY_NAMES))


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
