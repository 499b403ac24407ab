"""FSDP2 (``fully_shard``) with deferred weight gradients.

* :mod:`.reduction` -- :func:`defer_fsdp_reduction`: each FSDP2 group reduce-scatters its deferred gradients
  once its last wgrad task ran; :class:`FSDPReductionHandle`; :func:`fsdp_reduction_handle`, the lookup from a
  split layer to the handle managing it;
* :mod:`.stage` -- :class:`FSDPStage`: a ``fully_shard``-ed pipeline stage whose reduce-scatter is the
  schedule's ``RF`` action;
* :mod:`.background` -- the one worker thread of ``mode="async"``;
* :mod:`._fsdp2_private` -- every private FSDP2 name the glue touches, in one place.
"""

from __future__ import annotations

from .reduction import FSDPReductionHandle, ReductionMode, defer_fsdp_reduction, fsdp_reduction_handle
from .stage import FSDPStage

__all__ = [
    "FSDPReductionHandle",
    "FSDPStage",
    "ReductionMode",
    "defer_fsdp_reduction",
    "fsdp_reduction_handle",
]
