"""Parallel strategies built on split backward, one sub-room each.

* :mod:`.data` -- :class:`DistributedDataParallel`: data parallelism driven by gradient readiness (autograd
  hooks and splitgrad's wgrad hooks), every parameter's gradient in a ``main_grad`` view of a contiguous
  per-dtype buffer, buckets reduced asynchronously as soon as they are complete;
* :mod:`.fsdp` -- FSDP2 (``fully_shard``) with deferred weight gradients: :func:`defer_fsdp_reduction`,
  :class:`FSDPStage`, :func:`fsdp_reduction_handle`;
* :mod:`.tensor` -- tensor-parallel process groups and the TP config / collectives' public home;
* :mod:`.expert` -- expert parallelism (all-to-all token exchange, expert-DP reductions, batch-level overlap).

Process-group plumbing (group references, launch, teardown, bounded waits) is :mod:`splitgrad.distributed`'s;
:func:`destroy_process_group` is re-exported here.
"""

from __future__ import annotations

from ..distributed.teardown import destroy_process_group
from .data import DDPConfig, DistributedDataParallel
from .fsdp import FSDPReductionHandle, FSDPStage, defer_fsdp_reduction, fsdp_reduction_handle
from .tensor import TensorParallelConfig, TensorParallelGroups, tensor_parallel_groups

__all__ = [
    "DDPConfig",
    "DistributedDataParallel",
    "FSDPReductionHandle",
    "FSDPStage",
    "TensorParallelConfig",
    "TensorParallelGroups",
    "defer_fsdp_reduction",
    "destroy_process_group",
    "fsdp_reduction_handle",
    "tensor_parallel_groups",
]
