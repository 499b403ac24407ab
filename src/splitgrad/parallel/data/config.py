"""Options of :class:`~splitgrad.parallel.DistributedDataParallel`."""

from __future__ import annotations

import dataclasses
import datetime
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["DDPConfig"]

#: torch DDP's default bucket (``bucket_cap_mb=25``) expressed in float32 elements.
DEFAULT_BUCKET_SIZE = 25 * 2**20 // 4
#: torch DDP's first bucket (``dist._DEFAULT_FIRST_BUCKET_BYTES``, 1 MiB) expressed in float32 elements.
DEFAULT_FIRST_BUCKET_SIZE = 2**20 // 4


@dataclass(kw_only=True, slots=True)
class DDPConfig:
    """How gradients are laid out, reduced and exposed."""

    bucket_size: int | None = None
    """Elements per bucket (a bucket closes once it reaches this); None: 25 MiB of float32 (torch DDP's)."""

    first_bucket_size: int | None = None
    """Elements in the first bucket of each gradient buffer, the one launched first. None: at most 1 MiB of
    float32 (torch DDP's first bucket), or ``bucket_size`` when that is smaller. A small first bucket starts
    the first collective after the last layer's backward instead of after ``bucket_size`` elements of it."""

    overlap_grad_reduce: bool = True
    """Start each bucket's collective as soon as it is complete, during backward / ``backward_dw``. False:
    every collective is issued in ``finish_grad_sync()``."""

    grad_reduce_dtype: torch.dtype | None = torch.float32
    """dtype of ``main_grad`` and of the collective. None: each parameter's own dtype. A parameter of a wider
    floating dtype (float64) keeps its own, so no precision is silently lost."""

    average_in_collective: bool = True
    """Average inside the collective (``ReduceOp.AVG`` on NCCL, else divide by the world size before summing,
    like torch DDP). False: sum, then divide after the collective."""

    reduce_scatter: bool = False
    """Reduce-scatter instead of all-reduce, for a sharded optimizer: after ``finish_grad_sync()`` only this
    rank's shard of each bucket (``local_grad_shards()``) holds the average; ``.grad`` is not set."""

    allow_unused_parameters: bool = False
    """A parameter that received no gradient this step is reduced as it is (zero) instead of making
    ``finish_grad_sync()`` raise."""

    expose_grads: bool = True
    """After ``finish_grad_sync()``, set every parameter's ``.grad`` to its averaged ``main_grad`` (a view when
    the dtypes match, else a cast copy), so any ``torch.optim`` optimizer consumes it unchanged."""

    lazy_zero: bool = True
    """``zero_grad_buffer()`` (and the zeroing after ``optimizer.zero_grad()``) zeroes at once only the
    ``main_grad`` of parameters whose layer writes into it itself; the others are *marked* zero and written over
    by their first gradient, or zeroed when their bucket is reduced: no pass over the buffers per step (torch DDP
    zeroes nothing either: a new ``.grad`` each step). Until a slice's first gradient of the step it still holds
    the last step's values. A write into such a ``main_grad`` before that would land on them: one made between
    ``zero_grad_buffer()`` and the forward, or by a layer announcing it (``grad_added_to_main_grad``), raises a
    ``RuntimeError``; one made between the forward and the gradient without announcing is not detected. False:
    zero every buffer at once (such writes are added to zeros, at one more pass over memory per step)."""

    broadcast_at_init: bool = True
    """Broadcast parameters and buffers from the group's rank 0 when wrapping (torch DDP does the same)."""

    timeout: float | None = None
    """Seconds to wait for one bucket's collective before raising; None: the process group's own timeout."""

    def __post_init__(self) -> None:
        if self.bucket_size is not None and self.bucket_size <= 0:
            raise ValueError(f"DDPConfig: bucket_size must be positive, got {self.bucket_size=}")
        if self.first_bucket_size is not None and self.first_bucket_size <= 0:
            raise ValueError(f"DDPConfig: first_bucket_size must be positive, got {self.first_bucket_size=}")
        if self.grad_reduce_dtype is not None and not self.grad_reduce_dtype.is_floating_point:
            raise ValueError(
                f"DDPConfig: grad_reduce_dtype must be a floating dtype, got {self.grad_reduce_dtype=}"
            )
        if self.timeout is not None and self.timeout <= 0:
            raise ValueError(f"DDPConfig: timeout must be positive seconds or None, got {self.timeout=}")

    @classmethod
    def from_options(cls, config: DDPConfig | None, options: dict[str, Any], *, owner: str) -> DDPConfig:
        """``config``, or a config built from keyword ``options`` (the fields, by name); never both.

        Raises:
            ValueError: both given, ``config`` of another type, or an option that is not a field (named).
        """
        if config is not None and options:
            raise ValueError(
                f"{owner}: pass config=DDPConfig(...) or keyword options, not both; got {sorted(options)}"
            )
        if config is not None:
            if not isinstance(config, cls):
                raise ValueError(f"{owner}: config must be a DDPConfig, got {type(config).__name__}")
            return config
        unknown = sorted(set(options) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            known = sorted(f.name for f in dataclasses.fields(cls))
            raise ValueError(f"{owner}: unknown option(s) {unknown}; DDPConfig fields: {known}")
        return cls(**options)

    @property
    def resolved_bucket_size(self) -> int:
        return DEFAULT_BUCKET_SIZE if self.bucket_size is None else self.bucket_size

    @property
    def resolved_first_bucket_size(self) -> int:
        if self.first_bucket_size is not None:
            return self.first_bucket_size
        return min(DEFAULT_FIRST_BUCKET_SIZE, self.resolved_bucket_size)

    @property
    def wait_timeout(self) -> datetime.timedelta | None:
        return None if self.timeout is None else datetime.timedelta(seconds=self.timeout)

    def grad_dtype(self, param_dtype: torch.dtype) -> torch.dtype:
        """The ``main_grad`` dtype for a parameter of ``param_dtype``."""
        wanted = self.grad_reduce_dtype
        if wanted is None or not param_dtype.is_floating_point:
            return param_dtype
        return param_dtype if torch.finfo(param_dtype).bits > torch.finfo(wanted).bits else wanted
