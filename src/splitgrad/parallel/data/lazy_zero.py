"""Zeroing the gradient buffers at once, or lazily: which ``main_grad`` slices are only *marked* zero.

With ``DDPConfig.lazy_zero`` (the default) a new step zeroes at once only the slices that layers write into
themselves (``skip_backward_post_hook``); every other slice is marked zero: its parameter's first gradient is
written over it, and whatever is still marked when its bucket is reduced is zeroed then. Until then a marked
slice holds the last step's values, so a write into it would land on them; :class:`ZeroState` watches the
buffers' version counters between ``zero_grad_buffer()`` and the next forward, and refuses a layer that adds
into a marked slice without having announced it.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from .buckets import Bucket, GradBuffer

__all__ = ["ZeroState"]

_OWNER = "DistributedDataParallel"


class ZeroState:
    """Per parameter: whether its ``main_grad`` counts as zero but was not zeroed yet.

    Args:
        params: the managed parameters, by index (each with ``main_grad``).
        names: their names, for error messages.
        buffer_of: per index, the :class:`GradBuffer` holding that parameter's ``main_grad``.
        lazy: ``DDPConfig.lazy_zero``; False: every zeroing writes zeros at once.
    """

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        names: Sequence[str],
        buffer_of: Sequence[GradBuffer],
        *,
        lazy: bool,
    ) -> None:
        self._params, self._names, self._buffer_of, self.lazy = params, names, buffer_of, lazy
        self._pending = [False] * len(params)
        #: Buffer versions at a lazy zeroing, checked (once) by the next forward; None: not watching.
        self._watch: list[int] | None = None

    def zero_all(self, buffers: Sequence[GradBuffer]) -> None:
        """A new step: zero every buffer (eager), or mark every slice zero but the layer-written ones."""
        if not self.lazy:
            for buffer in buffers:
                buffer.data.zero_()
            return
        for idx in range(len(self._params)):
            self.zero_later(idx)

    def zero_later(self, idx: int) -> None:
        """Zero parameter ``idx``'s slice now if a layer may write into it (or zeroing is eager), else mark it."""
        p = self._params[idx]
        if not self.lazy or getattr(p, "skip_backward_post_hook", False):
            p.main_grad.zero_()
            self._pending[idx] = False
        else:
            self._pending[idx] = True

    def take(self, idx: int) -> bool:
        """Whether slice ``idx`` was marked zero; it is not any more (its first gradient is written over it)."""
        pending, self._pending[idx] = self._pending[idx], False
        return pending

    def start_watch(self, buffers: Sequence[GradBuffer]) -> None:
        """After zeroing: watch the buffers until the next forward when any slice is only marked zero."""
        self._watch = [b.data._version for b in buffers] if any(self._pending) else None

    def check_watch(self, buffers: Sequence[GradBuffer]) -> None:
        """Raise when a ``main_grad`` was written between a lazy zeroing and this forward (then stop watching)."""
        watch, self._watch = self._watch, None
        if watch is None:
            return
        for buffer, version in zip(buffers, watch):
            if buffer.data._version != version:
                marked = [
                    name
                    for i, name in enumerate(self._names)
                    if self._pending[i] and self._buffer_of[i] is buffer
                ]
                raise RuntimeError(
                    f"{_OWNER}: a main_grad was written between zero_grad_buffer() and the forward, while "
                    f"lazy_zero=True kept the last step's values in the {buffer.data.dtype} buffer of "
                    f"{marked[:4]}{' …' if len(marked) > 4 else ''} (only marked zero); the write landed on them. "
                    "Write into main_grad after the parameter's gradient arrived, or build the wrapper with "
                    "lazy_zero=False (zero every buffer at once)"
                )

    def any_pending_written_by_layers(self, skip: Sequence[bool]) -> bool:
        """Whether a slice only marked zero belongs to a parameter whose layer now writes it (``skip``)."""
        return any(pending and s for pending, s in zip(self._pending, skip))

    def materialize_written_by_layers(self, skip: Sequence[bool]) -> None:
        """Zero those slices: a layer switched to writing ``main_grad`` itself (``set_delay_wgrad_compute``, a
        fuse flag) after the zeroing adds into the slice, which must really be zero before its backward."""
        for idx, s in enumerate(skip):
            if s and self._pending[idx]:
                self._materialize(idx)

    def check_announced(self, idx: int) -> None:
        """A layer added parameter ``idx``'s gradient into ``main_grad``: refuse it when the slice was only marked
        zero (the parameter did not announce ``skip_backward_post_hook`` before the zeroing or forward)."""
        if self._pending[idx]:
            raise RuntimeError(
                f"{_OWNER}: a layer added the gradient of {self._names[idx]!r} into its main_grad, but the "
                "parameter did not announce that (skip_backward_post_hook) when the gradients were zeroed or the "
                "forward ran, so its slice was not zeroed first. Run every forward through the wrapper (ddp(x)) "
                "after switching delay_wgrad_compute / fusion"
            )

    def materialize_bucket(self, bucket: Bucket, indices: Sequence[int]) -> None:
        """Before ``bucket``'s collective reads it: zero its slices still marked (no gradient arrived)."""
        for p, idx in zip(bucket.params, indices):
            if not self._pending[idx]:
                continue
            if p.grad_added_to_main_grad:
                raise RuntimeError(
                    f"{_OWNER}: a layer added the gradient of {self._names[idx]!r} into its main_grad without "
                    "reporting it (no wgrad hook, no .grad), while lazy_zero=True kept the last step's values "
                    "there; announce it with skip_backward_post_hook before the forward, or build the wrapper "
                    "with lazy_zero=False"
                )
            self._materialize(idx)

    def _materialize(self, idx: int) -> None:
        buffer = self._buffer_of[idx]
        untouched = buffer.untouched
        self._params[idx].main_grad.zero_()
        buffer.rearm(untouched)
        self._pending[idx] = False
