"""The gradient sync of one data-parallel wrapper: contributions -> bucket launches -> ``finish``.

A contribution (from an autograd hook or a wgrad hook) is added into ``main_grad`` and counted; a bucket whose
parameters have all their expected contributions starts its asynchronous collective at once, in bucket order
on every rank; :meth:`GradSync.finish` issues the rest and waits for all. The work handles are only waited for
there (or when a step is abandoned: :meth:`GradSync.zero`, :meth:`GradSync.wait_in_flight`), never inside a
hook.

:class:`GradSync` owns every piece of that state (buffers, buckets, counts, the per-parameter flags of the
first-write and lazy-zero optimisations); :class:`~splitgrad.parallel.DistributedDataParallel` builds one,
wires its hooks to :meth:`GradSync.on_autograd_grad` / :meth:`GradSync.on_wgrad` and forwards its public calls.
Zeroing (eager or lazy) is :class:`~splitgrad.parallel.data.lazy_zero.ZeroState`'s.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ...distributed.group_ref import GroupRef
from .buckets import Bucket, build_buffers
from .config import DDPConfig
from .lazy_zero import ZeroState
from .readiness import StepCounts, count_contributions

__all__ = ["GradSync"]

logger = logging.getLogger(__name__)

_OWNER = "DistributedDataParallel"


class GradSync:
    """Buffers, buckets and readiness of one data-parallel group's parameters.

    Args:
        layout: ``(name, parameter)`` pairs in layout order (the wrapper passes reverse registration order,
            roughly backprop order, so buckets complete front to back); each gets ``param.main_grad``.
        config: the wrapper's options.
        group: where the data-parallel group is found (looked up at each use, never held).
        rank: this process's rank in the group; world_size: the group's size.
    """

    def __init__(
        self,
        layout: Sequence[tuple[str, nn.Parameter]],
        *,
        config: DDPConfig,
        group: GroupRef,
        rank: int,
        world_size: int,
    ) -> None:
        self.config = config
        self._group: GroupRef | None = group
        self.rank, self.world_size = rank, world_size
        self.params = [p for _, p in layout]
        self.names = [n for n, _ in layout]
        #: ``id(param) -> index`` into :attr:`params` (the hooks report indices).
        self.index_of = {id(p): i for i, p in enumerate(self.params)}
        self.buffers, self.buckets = build_buffers(
            layout,
            bucket_size=config.resolved_bucket_size,
            first_bucket_size=config.resolved_first_bucket_size,
            grad_dtype_for={p.dtype: config.grad_dtype(p.dtype) for p in self.params},
            world_size=world_size,
        )
        bucket_of = [0] * len(self.params)
        for bucket in self.buckets:
            for p in bucket.params:
                bucket_of[self.index_of[id(p)]] = bucket.index
        self.counts = StepCounts(bucket_of, len(self.buckets))
        self.zeros = ZeroState(
            self.params, self.names, [self.buckets[b].buffer for b in bucket_of], lazy=config.lazy_zero
        )
        #: Per parameter: its slice already holds this step's gradient divided by grad_divisor.
        self._predivided = [False] * len(self.params)
        self._lock = threading.RLock()
        self._sync = True
        self._next_bucket = 0
        self._grads_exposed = False
        self._exposed: list[torch.Tensor] = []
        #: Bucket indices in the order their collectives were issued this step (diagnostics, tests).
        self.launch_order: list[int] = []
        #: Of the last finished step: the launch order, and how many buckets were already reducing when
        #: finish() was called (all of them when backward hid every reduction).
        self.last_launch_order: list[int] = []
        self.last_launched_early = 0
        #: The reduced gradient is the sum over the group divided by this (default: the group's size, the
        #: average). Expert parameters set the dense data-parallel size: their gradient already sums the tokens
        #: of the whole expert-parallel group (see splitgrad.parallel.expert.ExpertDataParallel).
        self.grad_divisor = world_size

    @property
    def process_group(self) -> dist.ProcessGroup | None:
        """The group, looked up now; None once :meth:`release` dropped it."""
        return None if self._group is None else self._group.get()

    def release(self) -> None:
        """Forget the group (the wrapper was closed)."""
        self._group = None

    # -- the step's frame ----------------------------------------------------------------------------------
    def begin_forward(self) -> None:
        """Before a forward: refuse one while reductions run, check the lazy zeroing, take back ``.grad``."""
        if self._next_bucket and torch.is_grad_enabled():
            raise RuntimeError(
                f"{_OWNER}.forward: gradients of the previous backward are already being reduced "
                f"(buckets {self.launch_order} launched); call finish_grad_sync() before the next step, or run "
                "all but the last microbatch inside no_sync()"
            )
        self.zeros.check_watch(self.buffers)
        if self._grads_exposed:
            self._take_back_grads()

    def expect_backward(self, outputs: Any) -> None:
        """Count the contributions that backward over ``outputs`` (one forward's result) will bring."""
        if torch.is_grad_enabled():
            skip = [bool(getattr(p, "skip_backward_post_hook", False)) for p in self.params]
            if self.zeros.any_pending_written_by_layers(skip):
                with self._lock, torch.no_grad():
                    self.zeros.materialize_written_by_layers(skip)
            counts = count_contributions(outputs, self.index_of, skip)
            if counts:
                with self._lock:
                    self.counts.add_expected(counts)

    @property
    def syncing(self) -> bool:
        """False inside :meth:`no_sync`."""
        return self._sync

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Contributions arriving inside the block start no collective."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    def finish(self) -> None:
        """Issue the collectives not started yet, wait for all, leave the average in every ``main_grad``.

        Raises:
            RuntimeError: inside :meth:`no_sync`; a parameter received no gradient this step (unless
                ``allow_unused_parameters``); a collective failed or timed out.
        """
        if not self._sync:
            raise RuntimeError(f"{_OWNER}.finish_grad_sync() called inside no_sync()")
        with self._lock, torch.no_grad(), torch.profiler.record_function("splitgrad.ddp.finish_grad_sync"):
            launched_early = self._next_bucket
            if not self.config.allow_unused_parameters:
                self._check_all_arrived()
            while self._next_bucket < len(self.buckets):
                self._launch(self.buckets[self._next_bucket])
            for bucket in self.buckets:
                bucket.wait(self.config.wait_timeout, group=self.process_group)
            self.last_launch_order, self.last_launched_early = self.launch_order, launched_early
            self._start_new_step()
        if self.config.expose_grads and not self.config.reduce_scatter:
            self._exposed = [
                p.main_grad if p.main_grad.dtype == p.dtype else p.main_grad.to(p.dtype) for p in self.params
            ]
            for p, grad in zip(self.params, self._exposed):
                p.grad = grad
            self._grads_exposed = True

    def zero(self) -> None:
        """Zero (or, lazily, mark zero) every ``main_grad``, drop ``.grad``, start a new step (waits for
        in-flight reductions; see ``DDPConfig.lazy_zero``)."""
        with self._lock, torch.no_grad():
            for bucket in self.buckets:
                if bucket.in_flight:
                    bucket.wait(self.config.wait_timeout, group=self.process_group)
            self.zeros.zero_all(self.buffers)
            for p in self.params:
                p.grad = None
                p.grad_added_to_main_grad = False
            self._grads_exposed = False
            self._exposed = []
            self._start_new_step()
            for buffer in self.buffers:
                buffer.mark_zero()
            self.zeros.start_watch(self.buffers)

    def wait_in_flight(self) -> RuntimeError | None:
        """Wait for every reduction still in flight (the wrapper is closing); returns the first failure."""
        first_error: RuntimeError | None = None
        with self._lock:
            in_flight = [b.index for b in self.buckets if b.in_flight]
            if in_flight:
                logger.warning(
                    "rank %d: %s.close() with bucket(s) %s still reducing (finish_grad_sync() was not called): "
                    "waiting for them; their averages stay in the gradient buffers, not in .grad",
                    self.rank,
                    _OWNER,
                    in_flight,
                )
            for bucket in self.buckets:
                if bucket.in_flight:
                    try:
                        bucket.wait(self.config.wait_timeout, group=self.process_group)
                    except RuntimeError as exc:
                        first_error = first_error or exc
        return first_error

    # -- readiness (called from the hooks) ----------------------------------------------------------------
    def on_autograd_grad(self, idx: int, param: torch.Tensor) -> None:
        """Post-accumulate-grad hook of parameter ``idx``."""
        # Parameters whose module writes the gradient report through the wgrad hook; their AccumulateGrad
        # still runs (with no gradient) and must not count.
        if getattr(param, "skip_backward_post_hook", False) or param.grad is None:
            return
        self._contribute(idx)

    def on_wgrad(self, indices: tuple[int, ...]) -> None:
        """Wgrad hook of a store whose owner wrote the parameters ``indices``."""
        for idx in indices:
            p = self.params[idx]
            if p.grad is not None or p.grad_added_to_main_grad:
                self._contribute(idx)

    def _contribute(self, idx: int) -> None:
        p, name = self.params[idx], self.names[idx]
        # backward_dw may run with grad mode on: the buffer must never join an autograd graph.
        with self._lock, torch.no_grad():
            if self._grads_exposed:
                raise RuntimeError(
                    f"{_OWNER}: a gradient for {name!r} arrived after finish_grad_sync() before a new step "
                    "began; call ddp.zero_grad_buffer() (or run the next forward through the wrapper, ddp(x), "
                    "which takes back the exposed .grad views) first"
                )
            bucket = self.buckets[self.counts.bucket_of[idx]]
            if bucket.launched:
                raise RuntimeError(
                    f"{_OWNER}: a gradient for {name!r} arrived after its bucket {bucket.index} started reducing "
                    f"(contributions: expected {self.counts.expected[idx]}, this is number "
                    f"{self.counts.arrived[idx] + 1}). Run the model through the wrapper (ddp(x), not "
                    "ddp.module(x)), backward each forward's output once, wrap all but the last microbatch in "
                    "no_sync(), and keep parameters visible in the forward graph (reentrant activation "
                    "checkpointing hides them: use use_reentrant=False, or overlap_grad_reduce=False)"
                )
            if p.grad_added_to_main_grad:
                self.zeros.check_announced(idx)
                if self._predivided[idx]:
                    raise RuntimeError(
                        f"{_OWNER}: a gradient for {name!r} was added into main_grad after the step's only "
                        "announced gradient, already divided for the collective, was written there: the sum "
                        "would be wrong. Run every forward through the wrapper (ddp(x))"
                    )
                p.grad_added_to_main_grad = False
            elif p.grad.data_ptr() != p.main_grad.data_ptr():
                self._accumulate(idx, bucket, p.grad, p.main_grad)
            # else: .grad is the exposed main_grad view and autograd accumulated into it in place.
            p.grad = None
            self.counts.arrive(idx)
            if self._sync and self.config.overlap_grad_reduce and self.counts.complete(bucket.index):
                while self._next_bucket < len(self.buckets) and self.counts.complete(self._next_bucket):
                    self._launch(self.buckets[self._next_bucket])

    def _accumulate(self, idx: int, bucket: Bucket, grad: torch.Tensor, main_grad: torch.Tensor) -> None:
        """Add ``grad`` into ``main_grad`` — by writing it, when the slice is known to be zero.

        torch DDP copies each gradient into its bucket, dividing on the way; adding into zeros and dividing
        the bucket at launch costs one more pass over the gradient in the middle of backward. When this is
        the parameter's first contribution and its buffer was written by nothing but this wrapper since it
        was zeroed (``GradBuffer.untouched``), the slice is zero: write instead. When it is also the
        only contribution of the step (outside ``no_sync``) and the bucket is divided before the collective,
        divide while writing (the bits of adding then dividing, up to the sign of a zero: 0 + (-0) is +0) and
        let the launch skip that slice.
        """
        buffer, counts = bucket.buffer, self.counts
        untouched = buffer.untouched
        # A slice marked zero (zero()) holds stale values: its first gradient is written over them.
        zero = self.zeros.take(idx) or untouched
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
        self.zeros.materialize_bucket(bucket, [self.index_of[id(p)] for p in bucket.params])
        untouched = bucket.buffer.untouched
        with torch.profiler.record_function(f"splitgrad.ddp.reduce:bucket{bucket.index}"):
            bucket.launch(
                self.process_group,
                world_size=self.world_size,
                rank=self.rank,
                average=self._average_mode(bucket),
                reduce_scatter=self.config.reduce_scatter,
                divisor=self.grad_divisor,
                predivided=[self._predivided[self.index_of[id(p)]] for p in bucket.params],
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
        unused = self.counts.unused(range(len(self.params)))
        if not unused:
            return
        listed = "; ".join(
            f"{self.names[i]} ({f'in {e} forward graph(s)' if e else 'in no forward graph'})"
            for i, e in unused[:10]
        )
        more = f"; … {len(unused) - 10} more" if len(unused) > 10 else ""
        raise RuntimeError(
            f"{_OWNER}.finish_grad_sync(): {len(unused)} parameter(s) received no gradient on rank {self.rank}: "
            f"{listed}{more}. Unused in the forward, a forward whose output was not backwarded, or "
            "requires_grad changed after wrapping; pass allow_unused_parameters=True if unused parameters are "
            "expected"
        )

    def _start_new_step(self) -> None:
        for bucket in self.buckets:
            bucket.reset()
        # The buffers hold what the collectives wrote (no version bump): unknown until zeroed again.
        for buffer in self.buffers:
            buffer.mark_dirty()
        self._predivided = [False] * len(self.params)
        self.counts.reset()
        self._next_bucket = 0
        self.launch_order = []

    def _take_back_grads(self) -> None:
        """Start a step after finish() exposed ``.grad``: honour how the user zeroed it.

        ``optimizer.zero_grad()`` (set_to_none) leaves ``.grad`` None: zero that ``main_grad``. A view still in
        place was zeroed in place or kept on purpose (accumulate, as torch does): keep its data. A cast copy
        (parameter narrower than main_grad) is copied back, so whatever was done to it counts. Either way
        drop ``.grad``, so that autograd cannot accumulate into it out of place and be counted twice.
        """
        with self._lock, torch.no_grad():
            all_zeroed = all(p.grad is None for p in self.params)
            for idx, (name, p, exposed) in enumerate(zip(self.names, self.params, self._exposed)):
                grad = p.grad
                if grad is None:
                    self.zeros.zero_later(idx)
                    p.grad_added_to_main_grad = False
                elif grad is exposed or grad.data_ptr() == p.main_grad.data_ptr():
                    if grad.data_ptr() != p.main_grad.data_ptr():
                        p.main_grad.copy_(grad)
                    p.grad = None
                else:
                    raise RuntimeError(
                        f"{_OWNER}: {name}.grad was replaced by another tensor after finish_grad_sync(); it "
                        "would be added to main_grad again. Zero the gradients (ddp.zero_grad_buffer(), "
                        "ddp.zero_grad() or optimizer.zero_grad()) before the next step"
                    )
            self._grads_exposed = False
            self._exposed = []
            if all_zeroed:  # optimizer.zero_grad(): every slice was zeroed just now (padding always is)
                for buffer in self.buffers:
                    buffer.mark_zero()
