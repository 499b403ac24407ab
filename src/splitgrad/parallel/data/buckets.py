"""Contiguous gradient buffers and the buckets they are cut into.

One :class:`GradBuffer` per ``(device, dtype)`` holds every trainable parameter's gradient as a view
(``param.main_grad``). Parameters are laid out in the order given (the wrapper passes reverse registration
order, i.e. roughly backprop order) and the buffer is cut into :class:`Bucket`\\ s of about ``bucket_size``
elements (the first one of each buffer about ``first_bucket_size``, as torch DDP does, so that the first
collective starts early), each reduced by one asynchronous collective. A parameter never straddles two
buckets.

Nothing here knows about hooks or readiness; a bucket only knows how to start and finish its collective.
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from ...distributed.wait import bounded_wait

__all__ = ["Bucket", "GradBuffer", "build_buffers"]

logger = logging.getLogger(__name__)

#: Every parameter starts at a multiple of this many elements: 256 bytes for float32, the alignment vectorised
#: accelerator kernels and NCCL like. The padding is zero and costs nothing in correctness.
ALIGN = 64

# `reduce_scatter_tensor` was renamed in recent torch; keep both working (pyproject allows torch>=2.4).
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class GradBuffer:
    """A zero-initialised flat tensor holding the gradients of parameters of one ``(device, dtype)``.

    Args:
        dtype: the gradient (and reduction) dtype.
        device: where the buffer lives (the parameters' device).
        numel: total elements, padding included.
    """

    def __init__(self, dtype: torch.dtype, device: torch.device, numel: int) -> None:
        self.dtype = dtype
        self.device = device
        self.data = torch.zeros(numel, dtype=dtype, device=device)
        self.buckets: list[Bucket] = []
        self._zero_version: int | None = self.data._version

    # Known-zero tracking. A parameter's first gradient can be *written* into its slice (a copy, or a division
    # straight into it) instead of added to zeros, and its bucket then need not be divided again: one pass
    # over the gradient instead of two (add, then divide; the zeroing is paid either way). That is only
    # right while the slice is still zero, which the buffer's version counter tells: every in-place write
    # through any view of it bumps the counter. The owner re-arms the mark after each write of its own.
    def mark_zero(self) -> None:
        """Declare the buffer all zero (just zeroed): writes from now on are watched."""
        self._zero_version = self.data._version

    def mark_dirty(self) -> None:
        """Declare the contents unknown (e.g. after a collective, which bumps no version counter)."""
        self._zero_version = None

    @property
    def untouched(self) -> bool:
        """True when nothing but the owner's re-armed writes touched the buffer since :meth:`mark_zero`."""
        return self._zero_version is not None and self._zero_version == self.data._version

    def rearm(self, was_untouched: bool) -> None:
        """After a write of the owner's own: keep watching if the buffer was untouched before it."""
        self._zero_version = self.data._version if was_untouched else None

    def __repr__(self) -> str:
        return (
            f"GradBuffer({self.dtype}, {self.device}, numel={self.data.numel()}, buckets={len(self.buckets)})"
        )


class Bucket:
    """A contiguous slice of a :class:`GradBuffer` made of whole parameters, reduced by one collective.

    Attributes:
        index: position in the wrapper's launch order (collectives are issued in this order on every rank).
        params: the parameters whose ``main_grad`` lies in this bucket, in layout order.
        names: their qualified names (for error messages).
        param_ranges: ``(start, end)`` of each parameter inside :attr:`data` (elements).
        data: ``(numel,)`` view of the buffer; ``numel`` is a multiple of the world size.
    """

    def __init__(
        self,
        index: int,
        buffer: GradBuffer,
        start: int,
        end: int,
        params: Sequence[nn.Parameter],
        names: Sequence[str],
        param_ranges: Sequence[tuple[int, int]],
    ) -> None:
        self.index = index
        self.buffer = buffer
        self.params = tuple(params)
        self.names = tuple(names)
        self.param_ranges = tuple(param_ranges)
        self.data = buffer.data[start:end]
        self._work: dist.Work | None = None
        self._post_divide = 0
        self.launched = False

    @property
    def in_flight(self) -> bool:
        """Whether a collective was started and not yet waited for."""
        return self._work is not None

    @property
    def numel(self) -> int:
        return self.data.numel()

    def shard(self, rank: int, world_size: int) -> torch.Tensor:
        """``(numel / world_size,)`` view: the part of :attr:`data` a reduce-scatter leaves on ``rank``."""
        return self.data.view(world_size, -1)[rank]

    def launch(
        self,
        group: dist.ProcessGroup,
        *,
        world_size: int,
        rank: int,
        average: str,
        reduce_scatter: bool,
        divisor: int | None = None,
        predivided: Sequence[bool] | None = None,
    ) -> None:
        """Start the asynchronous collective over :attr:`data`.

        Args:
            group: the data-parallel process group.
            world_size: its size; rank: this process's rank in it.
            average: ``"op"`` (use ``ReduceOp.AVG``), ``"pre"`` (divide, then sum) or ``"post"`` (sum, then
                divide in :meth:`wait`).
            reduce_scatter: reduce-scatter (each rank keeps its :meth:`shard`) instead of all-reduce.
            divisor: what ``"pre"``/``"post"`` divide by (None: ``world_size``; ``"op"`` always averages).
            predivided: per parameter (in :attr:`params` order), whether its slice already holds its gradient
                divided by ``divisor`` (``"pre"`` only); those slices are not divided again.
        """
        if self.launched:
            raise RuntimeError(f"bucket {self.index} ({self.describe()}) was already launched this step")
        op = dist.ReduceOp.SUM
        if average == "op":
            op = dist.ReduceOp.AVG
        elif average == "pre":
            # torch DDP's reducer divides before summing too; doing the same keeps results bit-identical to it.
            done = predivided if predivided is not None else (False,) * len(self.params)
            if not any(done):
                self.data.div_(divisor or world_size)
            elif not all(done):
                # Padding and unused slices are zero: only the parameters not yet divided need it.
                for (lo, hi), skip in zip(self.param_ranges, done, strict=True):
                    if not skip:
                        self.data[lo:hi].div_(divisor or world_size)
        self._post_divide = (divisor or world_size) if average == "post" else 0
        if reduce_scatter:
            self._work = _reduce_scatter(
                self.shard(rank, world_size), self.data, op=op, group=group, async_op=True
            )
        else:
            self._work = dist.all_reduce(self.data, op=op, group=group, async_op=True)
        self.launched = True

    def wait(self, timeout: datetime.timedelta | None, *, group: dist.ProcessGroup | None) -> None:
        """Block until the collective finished (at most ``timeout``; None: the group's own timeout).

        Args:
            timeout: the limit.
            group: the group the collective runs on (for the rank in an error message).

        Raises:
            RuntimeError: never launched; or the collective failed or timed out (names the bucket and the rank).
        """
        if self._work is None:
            raise RuntimeError(f"bucket {self.index} ({self.describe()}) was never launched")
        work, self._work = self._work, None  # a failed collective is abandoned, not waited for twice
        bounded_wait(
            work,
            f"DistributedDataParallel: the gradient reduction of bucket {self.index} ({self.describe()})",
            timeout=timeout,
            group=group,
            hint="a peer rank probably never issued it: it ran a different number of backward passes, skipped "
            "finish_grad_sync(), or crashed",
        )
        if self._post_divide:
            self.data.div_(self._post_divide)

    def reset(self) -> None:
        """Forget this step's collective (after :meth:`wait`, or before any launch)."""
        if self._work is not None:
            raise RuntimeError(f"bucket {self.index} ({self.describe()}) is still being reduced")
        self.launched = False

    def describe(self, limit: int = 3) -> str:
        shown = ", ".join(self.names[:limit])
        more = f", … {len(self.names) - limit} more" if len(self.names) > limit else ""
        return f"{len(self.params)} param(s): {shown}{more}; {self.numel} x {self.buffer.dtype}"

    def __repr__(self) -> str:
        return f"Bucket({self.index}, {self.describe()}, launched={self.launched})"


def build_buffers(
    named_params: Sequence[tuple[str, nn.Parameter]],
    *,
    bucket_size: int,
    grad_dtype_for: dict[torch.dtype, torch.dtype],
    world_size: int,
    first_bucket_size: int | None = None,
) -> tuple[list[GradBuffer], list[Bucket]]:
    """Lay ``named_params`` out (in the given order) into per-``(device, dtype)`` buffers and buckets.

    Sets ``param.main_grad`` (a view into its buffer) on every parameter.

    Args:
        named_params: trainable parameters in layout order (the wrapper passes backprop order).
        bucket_size: a bucket is closed once it holds at least this many elements.
        grad_dtype_for: parameter dtype -> gradient buffer dtype.
        world_size: bucket sizes are padded to a multiple of it (reduce-scatter needs equal shards).
        first_bucket_size: the same for the first bucket of each buffer; None: ``bucket_size``.

    Returns:
        ``(buffers, buckets)``; buckets are ordered by the position of their first parameter in
        ``named_params``, which is the order their collectives are issued in.
    """
    groups: dict[tuple[torch.device, torch.dtype], list[tuple[int, str, nn.Parameter]]] = {}
    for pos, (name, p) in enumerate(named_params):
        groups.setdefault((p.device, grad_dtype_for[p.dtype]), []).append((pos, name, p))

    buffers: list[GradBuffer] = []
    cuts: list[_Cut] = []
    for (device, dtype), members in groups.items():
        # Plan this buffer's cuts first, then allocate it once.
        mine = [_Cut(start=0)]
        offset = 0
        for pos, name, p in members:
            cut = mine[-1]
            offset = _round_up(offset, ALIGN)
            cut.members.append((pos, name, p))
            cut.ranges.append((offset - cut.start, offset - cut.start + p.numel()))
            offset += p.numel()
            cap = bucket_size if len(mine) > 1 or first_bucket_size is None else first_bucket_size
            if offset - cut.start >= cap:
                offset = cut.close(offset, world_size)
                mine.append(_Cut(start=offset))
        if not mine[-1].members:
            mine.pop()
        else:
            offset = mine[-1].close(offset, world_size)
        buffer = GradBuffer(dtype, device, offset)
        buffers.append(buffer)
        for cut in mine:
            cut.buffer = buffer
        cuts.extend(mine)

    buckets: list[Bucket] = []
    for index, cut in enumerate(sorted(cuts, key=lambda c: c.members[0][0])):
        params = [p for _, _, p in cut.members]
        bucket = Bucket(
            index, cut.buffer, cut.start, cut.end, params, [n for _, n, _ in cut.members], cut.ranges
        )
        for p, (lo, hi) in zip(params, cut.ranges):
            p.main_grad = bucket.data[lo:hi].view(p.shape)
        cut.buffer.buckets.append(bucket)
        buckets.append(bucket)
    logger.debug(
        "laid out %d parameter(s) in %d buffer(s), %d bucket(s)",
        len(named_params),
        len(buffers),
        len(buckets),
    )
    return buffers, buckets


@dataclass(kw_only=True, slots=True)
class _Cut:
    """A planned bucket: whole parameters from ``start`` of a buffer, padded to a multiple of the world size."""

    start: int
    end: int = 0
    members: list[tuple[int, str, nn.Parameter]] = field(default_factory=list)
    ranges: list[tuple[int, int]] = field(default_factory=list)
    buffer: GradBuffer | None = None

    def close(self, offset: int, world_size: int) -> int:
        self.end = self.start + _round_up(offset - self.start, ALIGN * world_size)
        return self.end
