"""The gradient-sync half of :class:`~splitgrad.parallel.DistributedDataParallel`: readiness to finish.

A contribution (from an autograd hook or a wgrad hook) is added into ``main_grad`` and counted; a bucket whose
parameters have all their expected contributions starts its asynchronous collective at once, in bucket order
on every rank; :meth:`GradSync.finish_grad_sync` issues the rest and waits for all. The work handles are only
waited for there (or when a step is abandoned: ``zero_grad_buffer``, ``close``), never inside a hook.

Split from the wrapper (construction, forward, hooks' lifetime) so each file holds one idea; the methods use
the state the wrapper's constructor sets up (``_buckets``, ``_counts``, ``_params``, ``_lock``, ...).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from ..core import ensure_no_pending_wgrad

if TYPE_CHECKING:
    from .buckets import Bucket

__all__ = ["GradSync"]

logger = logging.getLogger(__name__)


class GradSync:
    """Mixin: contributions -> bucket launches -> ``finish_grad_sync`` (state from the wrapper's constructor)."""

    def finish_grad_sync(self) -> None:
        """Issue the collectives not started yet, wait for all, leave the average in every ``main_grad``.

        Raises:
            RuntimeError: inside :meth:`no_sync`; while weight-gradient work is pending; when a parameter
                received no gradient this step (unless ``allow_unused_parameters``); when a collective fails
                or times out.
        """
        self._check_open("finish_grad_sync()")
        if not self._sync:
            raise RuntimeError("DistributedDataParallel.finish_grad_sync() called inside no_sync()")
        ensure_no_pending_wgrad(self.module, what="DistributedDataParallel.finish_grad_sync()")
        with self._lock, torch.no_grad(), torch.profiler.record_function("splitgrad.ddp.finish_grad_sync"):
            launched_early = self._next_bucket
            if not self.config.allow_unused_parameters:
                self._check_all_arrived()
            while self._next_bucket < len(self._buckets):
                self._launch(self._buckets[self._next_bucket])
            for bucket in self._buckets:
                bucket.wait(self.config.wait_timeout, rank=self.rank)
            self.last_launch_order, self.last_launched_early = self.launch_order, launched_early
            self._start_new_step()
        if self.config.expose_grads and not self.config.reduce_scatter:
            self._exposed = [
                p.main_grad if p.main_grad.dtype == p.dtype else p.main_grad.to(p.dtype) for p in self._params
            ]
            for p, grad in zip(self._params, self._exposed):
                p.grad = grad
            self._grads_exposed = True

    def zero_grad_buffer(self) -> None:
        """Zero every ``main_grad``, drop ``.grad``, and start a new step (waits for in-flight reductions).

        With ``lazy_zero`` (default) only the slices a layer writes into itself (``skip_backward_post_hook``)
        are zeroed now; every other slice is *marked* zero: the wrapper writes the parameter's first gradient
        over it, and zeroes what is still marked when its bucket is reduced (so after
        :meth:`finish_grad_sync` every ``main_grad`` is right). torch DDP zeroes nothing either (a new
        ``.grad`` each step); a pass over every buffer was a third of the wrapper's CPU cost per step.
        """
        self._check_open("zero_grad_buffer()")
        ensure_no_pending_wgrad(self.module, what="DistributedDataParallel.zero_grad_buffer()")
        with self._lock, torch.no_grad():
            for bucket in self._buckets:
                if bucket.in_flight:
                    bucket.wait(self.config.wait_timeout, rank=self.rank)
            if not self.config.lazy_zero:
                for buffer in self._buffers:
                    buffer.data.zero_()
            for idx, p in enumerate(self._params):
                if self.config.lazy_zero:
                    self._zero_later(idx)
                p.grad = None
                p.grad_added_to_main_grad = False
            self._grads_exposed = False
            self._exposed = []
            self._start_new_step()
            for buffer in self._buffers:
                buffer.mark_zero()
            # Watched until the next forward: a write into a slice only marked zero would land on stale values.
            self._stale_watch = [b.data._version for b in self._buffers] if any(self._pending_zero) else None

    def _check_stale_watch(self) -> None:
        """Raise when a ``main_grad`` was written between a lazy ``zero_grad_buffer()`` and this forward."""
        watch, self._stale_watch = self._stale_watch, None
        if watch is None:
            return
        for buffer, version in zip(self._buffers, watch):
            if buffer.data._version != version:
                marked = [
                    name
                    for i, name in enumerate(self._names)
                    if self._pending_zero[i] and self._buckets[self._counts.bucket_of[i]].buffer is buffer
                ]
                raise RuntimeError(
                    "DistributedDataParallel: a main_grad was written between zero_grad_buffer() and the forward, "
                    f"while lazy_zero=True kept the last step's values in the {buffer.data.dtype} buffer of "
                    f"{marked[:4]}{' …' if len(marked) > 4 else ''} (only marked zero); the write landed on them. "
                    "Write into main_grad after the parameter's gradient arrived, or build the wrapper with "
                    "lazy_zero=False (zero every buffer at once)"
                )

    def _zero_later(self, idx: int) -> None:
        """Zero parameter ``idx``'s slice now if a layer may write into it, else mark it zero (see above)."""
        p = self._params[idx]
        if not self.config.lazy_zero or getattr(p, "skip_backward_post_hook", False):
            p.main_grad.zero_()
            self._pending_zero[idx] = False
        else:
            self._pending_zero[idx] = True

    def _zero_pending_written_by_layers(self, skip: list[bool]) -> None:
        # A layer switched to writing main_grad itself (set_delay_wgrad_compute, fuse flag) after the zeroing:
        # it adds into the slice, which must really be zero before its backward.
        if any(pending and s for pending, s in zip(self._pending_zero, skip)):
            with self._lock, torch.no_grad():
                for idx, s in enumerate(skip):
                    if s and self._pending_zero[idx]:
                        self._materialize_zero(idx)

    def _materialize_zero(self, idx: int) -> None:
        buffer = self._buckets[self._counts.bucket_of[idx]].buffer
        untouched = buffer.untouched
        self._params[idx].main_grad.zero_()
        buffer.rearm(untouched)
        self._pending_zero[idx] = False

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Same as :meth:`zero_grad_buffer` (``set_to_none`` is accepted for ``nn.Module`` compatibility)."""
        del set_to_none
        self.zero_grad_buffer()

    def local_grad_shards(self) -> list[torch.Tensor]:
        """Per bucket, the ``(numel / world_size,)`` shard this rank owns (averaged after a reduce-scatter)."""
        return [b.shard(self.rank, self.world_size) for b in self._buckets]

    # -- readiness (called from the hooks) ----------------------------------------------------------------------------------------
    def _on_autograd_grad(self, idx: int, param: torch.Tensor) -> None:
        # Parameters whose module writes the gradient report through the wgrad hook; their AccumulateGrad
        # still runs (with no gradient) and must not count.
        if getattr(param, "skip_backward_post_hook", False) or param.grad is None:
            return
        self._contribute(idx)

    def _on_wgrad(self, indices: tuple[int, ...]) -> None:
        for idx in indices:
            p = self._params[idx]
            if p.grad is not None or p.grad_added_to_main_grad:
                self._contribute(idx)

    def _contribute(self, idx: int) -> None:
        p = self._params[idx]
        # backward_dw may run with grad mode on: the buffer must never join an autograd graph.
        with self._lock, torch.no_grad():
            if self._grads_exposed:
                raise RuntimeError(
                    f"DistributedDataParallel: a gradient for {self._names[idx]!r} arrived after "
                    "finish_grad_sync() before a new step began; call ddp.zero_grad_buffer() (or run the next "
                    "forward through the wrapper, ddp(x), which takes back the exposed .grad views) first"
                )
            bucket = self._buckets[self._counts.bucket_of[idx]]
            if bucket.launched:
                raise RuntimeError(
                    f"DistributedDataParallel: a gradient for {self._names[idx]!r} arrived after its bucket "
                    f"{bucket.index} started reducing (contributions: expected {self._counts.expected[idx]}, "
                    f"this is number {self._counts.arrived[idx] + 1}). Run the model through the wrapper "
                    "(ddp(x), not ddp.module(x)), backward each forward's output once, wrap all but the last "
                    "microbatch in no_sync(), and keep parameters visible in the forward graph (reentrant "
                    "activation checkpointing hides them: use use_reentrant=False, or overlap_grad_reduce=False)"
                )
            main_grad = p.main_grad
            if p.grad_added_to_main_grad and self._pending_zero[idx]:
                raise RuntimeError(
                    f"DistributedDataParallel: a layer added the gradient of {self._names[idx]!r} into its "
                    "main_grad, but the parameter did not announce that (skip_backward_post_hook) when the "
                    "gradients were zeroed or the forward ran, so its slice was not zeroed first. Run every "
                    "forward through the wrapper (ddp(x)) after switching delay_wgrad_compute / fusion"
                )
            if p.grad_added_to_main_grad:
                if self._predivided[idx]:
                    raise RuntimeError(
                        f"DistributedDataParallel: a gradient for {self._names[idx]!r} was added into main_grad "
                        "after the step's only announced gradient, already divided for the collective, was "
                        "written there: the sum would be wrong. Run every forward through the wrapper (ddp(x))"
                    )
                p.grad_added_to_main_grad = False
            elif p.grad.data_ptr() != main_grad.data_ptr():
                self._accumulate(idx, bucket, p.grad, main_grad)
            # else: .grad is the exposed main_grad view and autograd accumulated into it in place.
            p.grad = None
            self._counts.arrive(idx)
            if self._sync and self.config.overlap_grad_reduce and self._counts.complete(bucket.index):
                while self._next_bucket < len(self._buckets) and self._counts.complete(self._next_bucket):
                    self._launch(self._buckets[self._next_bucket])

    def _accumulate(self, idx: int, bucket: Bucket, grad: torch.Tensor, main_grad: torch.Tensor) -> None:
        """Add ``grad`` into ``main_grad`` — by writing it, when the slice is known to be zero.

        torch DDP copies each gradient into its bucket, dividing on the way; adding into zeros and dividing
        the bucket at launch costs one more pass over the gradient in the middle of backward. When this is
        the parameter's first contribution and its buffer was written by nothing but this wrapper since it
        was zeroed (:meth:`GradBuffer.untouched`), the slice is zero: write instead. When it is also the
        only contribution of the step (outside ``no_sync``) and the bucket is divided before the collective,
        divide while writing (the bits of adding then dividing, up to the sign of a zero: 0 + (-0) is +0) and
        let the launch skip that slice.
        """
        buffer, counts = bucket.buffer, self._counts
        untouched = buffer.untouched
        # A slice marked zero (zero_grad_buffer) holds stale values: its first gradient is written over them.
        zero = untouched or self._pending_zero[idx]
        self._pending_zero[idx] = False
        if self._predivided[idx]:
            # A contribution no forward announced, after this slice was divided: undo the division first.
            main_grad.mul_(self.grad_divisor).add_(grad)
            self._predivided[idx] = False
        elif zero and counts.arrived[idx] == 0:
            if self._sync and counts.expected[idx] == 1 and self._average_mode(bucket) == "pre":
                torch.div(grad, self.grad_divisor, out=main_grad)
                self._predivided[idx] = True
            else:
                main_grad.copy_(grad)
        else:
            main_grad.add_(grad)
        buffer.rearm(untouched)

    def _average_mode(self, bucket: Bucket) -> str:
        if self.config.average_in_collective:
            custom = self.grad_divisor != self.world_size  # ReduceOp.AVG divides by the group size only
            return "op" if self._supports_avg(bucket) and not custom else "pre"
        return "post"

    def _launch(self, bucket: Bucket) -> None:
        # Slices still marked zero (no gradient arrived) are zeroed now, before the collective reads them.
        for p in bucket.params:
            idx = self._index_of[id(p)]
            if self._pending_zero[idx]:
                if p.grad_added_to_main_grad:
                    raise RuntimeError(
                        f"DistributedDataParallel: a layer added the gradient of {self._names[idx]!r} into its "
                        "main_grad without reporting it (no wgrad hook, no .grad), while lazy_zero=True kept "
                        "the last step's values there; announce it with skip_backward_post_hook before the "
                        "forward, or build the wrapper with lazy_zero=False"
                    )
                self._materialize_zero(idx)
        untouched = bucket.buffer.untouched
        with torch.profiler.record_function(f"splitgrad.ddp.reduce:bucket{bucket.index}"):
            bucket.launch(
                self.process_group,
                world_size=self.world_size,
                rank=self.rank,
                average=self._average_mode(bucket),
                reduce_scatter=self.config.reduce_scatter,
                divisor=self.grad_divisor,
                predivided=[self._predivided[self._index_of[id(p)]] for p in bucket.params],
            )
        # The collective writes the bucket later without a version bump; the division was ours. Its other
        # buckets' slices are still watched (a launched bucket takes no more contributions).
        bucket.buffer.rearm(untouched)
        self._next_bucket = bucket.index + 1
        self.launch_order.append(bucket.index)
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("rank %d launched bucket %d (%s)", self.rank, bucket.index, bucket.describe())

    def _supports_avg(self, bucket: Bucket) -> bool:
        # NCCL averages natively; gloo does not everywhere (and torch DDP pre-divides on it), so pre-divide.
        return bucket.buffer.device.type != "cpu" and "nccl" in str(dist.get_backend(self.process_group))

    def _check_all_arrived(self) -> None:
        unused = self._counts.unused(range(len(self._params)))
        if not unused:
            return
        listed = "; ".join(
            f"{self._names[i]} ({f'in {e} forward graph(s)' if e else 'in no forward graph'})"
            for i, e in unused[:10]
        )
        more = f"; … {len(unused) - 10} more" if len(unused) > 10 else ""
        raise RuntimeError(
            f"DistributedDataParallel.finish_grad_sync(): {len(unused)} parameter(s) received no gradient on "
            f"rank {self.rank}: {listed}{more}. Unused in the forward, a forward whose output was not "
            "backwarded, or requires_grad changed after wrapping; pass allow_unused_parameters=True if "
            "unused parameters are expected"
        )

    def _start_new_step(self) -> None:
        for bucket in self._buckets:
            bucket.reset()
        # The buffers hold what the collectives wrote (no version bump): unknown until zeroed again.
        for buffer in self._buffers:
            buffer.mark_dirty()
        self._predivided = [False] * len(self._params)
        self._counts.reset()
        self._next_bucket = 0
        self.launch_order = []

    def _take_back_grads(self) -> None:
        """Start a step after finish_grad_sync() exposed ``.grad``: honour how the user zeroed it.

        ``optimizer.zero_grad()`` (set_to_none) leaves ``.grad`` None: zero that ``main_grad``. A view still in
        place was zeroed in place or kept on purpose (accumulate, as torch does): keep its data. A cast copy
        (parameter narrower than main_grad) is copied back, so whatever was done to it counts. Either way
        drop ``.grad``, so that autograd cannot accumulate into it out of place and be counted twice.
        """
        with self._lock, torch.no_grad():
            all_zeroed = all(p.grad is None for p in self._params)
            for idx, (name, p, exposed) in enumerate(zip(self._names, self._params, self._exposed)):
                grad = p.grad
                if grad is None:
                    self._zero_later(idx)
                    p.grad_added_to_main_grad = False
                elif grad is exposed or grad.data_ptr() == p.main_grad.data_ptr():
                    if grad.data_ptr() != p.main_grad.data_ptr():
                        p.main_grad.copy_(grad)
                    p.grad = None
                else:
                    raise RuntimeError(
                        f"DistributedDataParallel: {name}.grad was replaced by another tensor after "
                        "finish_grad_sync(); it would be added to main_grad again. Zero the gradients "
                        "(ddp.zero_grad_buffer(), ddp.zero_grad() or optimizer.zero_grad()) before the next step"
                    )
            self._grads_exposed = False
            self._exposed = []
            if all_zeroed:  # optimizer.zero_grad(): every slice was zeroed just now (padding always is)
                for buffer in self._buffers:
                    buffer.mark_zero()
