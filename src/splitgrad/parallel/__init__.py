"""Data parallelism driven by gradient readiness (autograd hooks and splitgrad's wgrad hooks).

:class:`DistributedDataParallel` gives every trainable parameter a ``main_grad`` view into a contiguous
per-dtype buffer, reduces buckets asynchronously as soon as all their gradients (deferred weight gradients
included) have arrived, and leaves the data-parallel average in ``main_grad`` after ``finish_grad_sync()``.
"""

from __future__ import annotations

from ..distributed.teardown import destroy_process_group
from .buckets import Bucket, GradBuffer
from .config import DDPConfig
from .ddp import DistributedDataParallel
from .fsdp import FSDPReductionHandle, defer_fsdp_reduction
from .fsdp_stage import FSDPStage
from .tensor import TensorParallelConfig, TensorParallelGroups, tensor_parallel_groups

__all__ = [
    "Bucket",
    "DDPConfig",
    "DistributedDataParallel",
    "FSDPReductionHandle",
    "FSDPStage",
    "GradBuffer",
    "TensorParallelConfig",
    "TensorParallelGroups",
    "defer_fsdp_reduction",
    "destroy_process_group",
    "tensor_parallel_groups",
]
