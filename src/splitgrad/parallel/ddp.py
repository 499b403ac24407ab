"""Data parallelism driven by gradient readiness, deferred weight gradients included.

With ``delay_wgrad_compute`` a weight gradient does not exist when autograd's ``AccumulateGrad`` runs, so a
DDP listening to autograd reduces nothing (or garbage). This wrapper learns that a gradient is ready from two
sources and treats them alike:

* parameters whose gradient flows through autograd: a post-accumulate-grad hook;
* parameters with ``skip_backward_post_hook`` (their module writes the gradient itself, in ``backward_dw`` or,
  when fused, inside backward): the owning module's/op's ``register_wgrad_accumulation_and_reduce_hooks``.

Either hook adds any ``.grad`` into ``param.main_grad`` (a view into a contiguous per-dtype buffer), drops
``.grad``, and records one contribution. A bucket whose parameters have all their expected contributions
(see :mod:`splitgrad.parallel.readiness`) starts its asynchronous collective at once, overlapping the rest of
backward / ``backward_dw``; collectives are issued in bucket order on every rank, so ranks whose buckets
complete in different orders still pair them correctly. ``finish_grad_sync()`` waits for all of them.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..core import ensure_no_pending_wgrad, split_modules
from .buckets import Bucket, GradBuffer, build_buffers
from .config import DDPConfig
from .readiness import StepCounts, count_contributions

__all__ = ["DistributedDataParallel"]

logger = logging.getLogger(__name__)


class DistributedDataParallel(nn.Module):
    """Wrap ``module`` for data-parallel training with overlapped, wgrad-aware gradient reduction.

    Every trainable parameter gets ``param.main_grad``; after :meth:`finish_grad_sync` it holds the
    data-parallel **average** (and, with ``expose_grads``, ``param.grad`` points at it). Training loop::

        ddp = DistributedDataParallel(model, process_group=pg)
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
        for x, y in batches:
            ddp.zero_grad_buffer()
            loss_fn(ddp(x), y).backward()
            splitgrad.backward_dw(ddp)      # only needed with delay_wgrad_compute
            ddp.finish_grad_sync()          # waits for the overlapped reductions
            opt.step()

    Args:
        module: the model; available as ``.module``. Call it through this wrapper (``ddp(x)``): the wrapper
            reads each forward's autograd graph to know how many gradient contributions to wait for.
        process_group: the data-parallel group; None: the default (world) group.
        config: the options (:class:`DDPConfig`, one docstring per field); None: the defaults.
        **options: :class:`DDPConfig` fields as keyword arguments instead (``bucket_size=...``), a shorthand
            for ``config=DDPConfig(...)``; not both.

    Raises:
        ValueError: ``config`` and keyword options together, an option :class:`DDPConfig` does not have, an
            invalid option value (see :class:`DDPConfig`), no trainable parameters, parameters that
            already have ``.grad`` or ``main_grad``.
        RuntimeError: torch.distributed is not initialised, or wgrad work is pending in ``module``.
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        process_group: dist.ProcessGroup | None = None,
        config: DDPConfig | None = None,
        **options: Any,
    ) -> None:
        super().__init__()
        self._closed = False
        self.config = DDPConfig.from_options(config, options, owner="DistributedDataParallel")
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "DistributedDataParallel needs torch.distributed initialised (init_process_group)"
            )
        self.module = module
        # The default group is looked up at each use, never stored: a reference held past
        # destroy_process_group() keeps the group alive until interpreter exit, where gloo may abort. That
        # includes the default group passed explicitly (`process_group=dist.group.WORLD`, the common spelling).
        self._group = None if process_group is dist.group.WORLD else process_group
        self.rank = dist.get_rank(self.process_group)
        self.world_size = dist.get_world_size(self.process_group)
        ensure_no_pending_wgrad(module, what="DistributedDataParallel construction")

        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError(f"DistributedDataParallel: {type(module).__name__} has no trainable parameters")
        for name, p in named:
            if p.grad is not None:
                raise ValueError(
                    f"DistributedDataParallel: parameter {name!r} already has a .grad; it would be reduced or "
                    "lost unnoticed. Call model.zero_grad(set_to_none=True) before wrapping"
                )
            if hasattr(p, "main_grad"):
                raise ValueError(
                    f"DistributedDataParallel: parameter {name!r} already has a main_grad (wrapped twice?); "
                    "call remove_hooks() on the other wrapper first"
                )
        # Reverse registration order approximates backprop order, so buckets complete front to back.
        layout = list(reversed(named))
        self._params = [p for _, p in layout]
        self._names = [n for n, _ in layout]
        self._index_of = {id(p): i for i, p in enumerate(self._params)}
        self._buffers, self._buckets = build_buffers(
            layout,
            bucket_size=self.config.resolved_bucket_size,
            grad_dtype_for={p.dtype: self.config.grad_dtype(p.dtype) for p in self._params},
            world_size=self.world_size,
        )
        bucket_of = [0] * len(self._params)
        for bucket in self._buckets:
            for p in bucket.params:
                bucket_of[self._index_of[id(p)]] = bucket.index
        self._counts = StepCounts(bucket_of, len(self._buckets))
        self._lock = threading.RLock()
        self._sync = True
        self._next_bucket = 0
        self._grads_exposed = False
        self._exposed: list[torch.Tensor] = []
        #: Bucket indices in the order their collectives were issued this step (diagnostics, tests).
        self.launch_order: list[int] = []
        #: Of the last finished step: the launch order, and how many buckets were already reducing when
        #: finish_grad_sync() was called (all of them when backward hid every reduction).
        self.last_launch_order: list[int] = []
        self.last_launched_early = 0
        #: The reduced gradient is the sum over the group divided by this (default: the group's size, the
        #: average). Expert parameters set the dense data-parallel size: their gradient already sums the tokens
        #: of the whole expert-parallel group (see splitgrad.parallel.expert.ExpertDataParallel).
        self.grad_divisor = self.world_size

        # The hooks live on the parameters and stores, which the wrapper reaches through self.module: a hook
        # holding the wrapper strongly makes a cycle through C++ (the parameters' hook tables) that Python's
        # gc cannot see, so the wrapper, and with it the process group, would never be freed. The group then
        # outlives destroy_process_group() and gloo aborts the process at exit. Hooks hold a weak reference.
        self._handles: list[Any] = []
        for i, p in enumerate(self._params):
            p.grad_added_to_main_grad = False
            self._handles.append(p.register_post_accumulate_grad_hook(_weak_hook(self._on_autograd_grad, i)))
        # One hook per store: a composite op exposes its inner op's store (and hooks) as its own, and
        # registering on both would count every contribution twice.
        owners: dict[int, tuple[nn.Module, list[int]]] = {}
        for _, owner in split_modules(module):
            _, owned = owners.setdefault(id(owner.wgrad_store), (owner, []))
            for p in owner.get_backward_dw_params():
                idx = self._index_of.get(id(p))
                if idx is not None and idx not in owned:
                    owned.append(idx)
        for owner, owned in owners.values():
            if owned:
                hook = _weak_hook(self._on_wgrad, tuple(owned))
                self._handles.append(owner.register_wgrad_accumulation_and_reduce_hooks(hook))
        # A wrapper dropped without close() detaches like remove_hooks(): its hooks could only call a dead
        # wrapper, and a stale main_grad would pin the buffer and refuse the next wrapper.
        self._finalizer = weakref.finalize(self, _detach, self._handles, self._params)
        self._finalizer.atexit = False
        if self.config.broadcast_at_init:
            self.broadcast_params()
        logger.debug("%s", self)

    # -- public API ---------------------------------------------------------------------------------------
    @property
    def process_group(self) -> dist.ProcessGroup | None:
        """The data-parallel group (the default group, looked up now, when none was given); None once closed."""
        if self._closed:
            return None
        return self._group if self._group is not None else dist.group.WORLD

    @property
    def buckets(self) -> tuple[Bucket, ...]:
        """The buckets, in the order their collectives are issued."""
        return tuple(self._buckets)

    @property
    def grad_buffers(self) -> tuple[GradBuffer, ...]:
        return tuple(self._buffers)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run ``self.module(*args, **kwargs)`` and count the gradient contributions its graph implies."""
        self.begin_forward()
        out = self.module(*args, **kwargs)
        self.expect_backward(out)
        return out

    def begin_forward(self) -> None:
        """What :meth:`forward` does before running the module (for wrappers that run it themselves).

        Raises:
            RuntimeError: the previous step's reductions already started and were not finished, or the
                wrapper was closed.
        """
        self._check_open("forward")
        if self._next_bucket and torch.is_grad_enabled():
            raise RuntimeError(
                "DistributedDataParallel.forward: gradients of the previous backward are already being reduced "
                f"(buckets {self.launch_order} launched); call finish_grad_sync() before the next step, or run "
                "all but the last microbatch inside no_sync()"
            )
        if self._grads_exposed:
            self._take_back_grads()

    def expect_backward(self, outputs: Any) -> None:
        """Count the gradient contributions that backward over ``outputs`` (one forward's result) will bring.

        :meth:`forward` calls it; a wrapper that runs the module once for several data-parallel wrappers (one
        per parameter group, e.g. expert and dense parameters) calls :meth:`begin_forward` and this on each.
        """
        if torch.is_grad_enabled():
            skip = [bool(getattr(p, "skip_backward_post_hook", False)) for p in self._params]
            counts = count_contributions(outputs, self._index_of, skip)
            if counts:
                with self._lock:
                    self._counts.add_expected(counts)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally: contributions arriving inside the block start no collective.

        Use it for every microbatch but the last; contributions of all microbatches are counted, so a
        deferred weight gradient of an earlier microbatch that runs after the block (zero-bubble schedules)
        still delays its bucket until it has arrived.
        """
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

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
        """Zero every ``main_grad``, drop ``.grad``, and start a new step (waits for in-flight reductions)."""
        self._check_open("zero_grad_buffer()")
        ensure_no_pending_wgrad(self.module, what="DistributedDataParallel.zero_grad_buffer()")
        with self._lock, torch.no_grad():
            for bucket in self._buckets:
                if bucket.in_flight:
                    bucket.wait(self.config.wait_timeout, rank=self.rank)
            for buffer in self._buffers:
                buffer.data.zero_()
            for p in self._params:
                p.grad = None
                p.grad_added_to_main_grad = False
            self._grads_exposed = False
            self._exposed = []
            self._start_new_step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Same as :meth:`zero_grad_buffer` (``set_to_none`` is accepted for ``nn.Module`` compatibility)."""
        del set_to_none
        self.zero_grad_buffer()

    def broadcast_params(self) -> None:
        """Copy parameters and buffers of the group's rank 0 to every rank."""
        self._check_open("broadcast_params()")
        src = dist.get_global_rank(self.process_group, 0)
        tensors = [p.detach() for p in self.module.parameters()] + [b.detach() for b in self.module.buffers()]
        works = [dist.broadcast(t, src=src, group=self.process_group, async_op=True) for t in tensors]
        timeout = self.config.wait_timeout
        for work in works:
            try:
                work.wait() if timeout is None else work.wait(timeout=timeout)
            except Exception as exc:
                raise RuntimeError(
                    f"DistributedDataParallel.broadcast_params: broadcast from rank {src} did not complete on "
                    f"rank {self.rank} ({exc}); did every rank construct the wrapper / call broadcast_params()?"
                ) from exc

    def local_grad_shards(self) -> list[torch.Tensor]:
        """Per bucket, the ``(numel / world_size,)`` shard this rank owns (averaged after a reduce-scatter)."""
        return [b.shard(self.rank, self.world_size) for b in self._buckets]

    def remove_hooks(self) -> None:
        """Detach from the module: remove every hook and the ``main_grad`` attributes."""
        _detach(self._handles, self._params)
        # Nothing left to clean up when the wrapper dies; running later, the finalizer would strip the
        # main_grad of a wrapper built on these parameters since.
        self._finalizer.detach()

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    def close(self) -> None:
        """Release the process group: wait for reductions in flight, detach from the module, drop the group.

        Call it (or use the wrapper as a context manager) before ``dist.destroy_process_group()`` to release
        every handle on the group deterministically; a wrapper that is simply dropped releases them too, when
        it is garbage-collected. Idempotent. Afterwards the wrapper refuses to run; the module keeps its
        parameters and whatever ``.grad`` the last :meth:`finish_grad_sync` exposed.

        Raises:
            RuntimeError: a reduction still in flight failed or timed out (everything is released anyway).
        """
        if self._closed:
            return
        self._closed = True
        first_error: RuntimeError | None = None
        with self._lock:
            in_flight = [b.index for b in self._buckets if b.in_flight]
            if in_flight:
                logger.warning(
                    "rank %d: DistributedDataParallel.close() with bucket(s) %s still reducing "
                    "(finish_grad_sync() was not called): waiting for them; their averages stay in the "
                    "gradient buffers, not in .grad",
                    self.rank,
                    in_flight,
                )
            for bucket in self._buckets:
                if bucket.in_flight:
                    try:
                        bucket.wait(self.config.wait_timeout, rank=self.rank)
                    except RuntimeError as exc:
                        first_error = first_error or exc
            self.remove_hooks()
            self._group = None
        if first_error is not None:
            raise first_error

    def __enter__(self) -> DistributedDataParallel:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise RuntimeError(f"DistributedDataParallel.{what}: the wrapper was closed (close())")

    # -- readiness ----------------------------------------------------------------------------------------
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
            if p.grad_added_to_main_grad:
                p.grad_added_to_main_grad = False
            elif p.grad.data_ptr() != main_grad.data_ptr():
                main_grad.add_(p.grad)
            # else: .grad is the exposed main_grad view and autograd accumulated into it in place.
            p.grad = None
            self._counts.arrive(idx)
            if self._sync and self.config.overlap_grad_reduce and self._counts.complete(bucket.index):
                while self._next_bucket < len(self._buckets) and self._counts.complete(self._next_bucket):
                    self._launch(self._buckets[self._next_bucket])

    def _launch(self, bucket: Bucket) -> None:
        if self.config.average_in_collective:
            custom = self.grad_divisor != self.world_size  # ReduceOp.AVG divides by the group size only
            average = "op" if self._supports_avg(bucket) and not custom else "pre"
        else:
            average = "post"
        with torch.profiler.record_function(f"splitgrad.ddp.reduce:bucket{bucket.index}"):
            bucket.launch(
                self.process_group,
                world_size=self.world_size,
                rank=self.rank,
                average=average,
                reduce_scatter=self.config.reduce_scatter,
                divisor=self.grad_divisor,
            )
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
            for name, p, exposed in zip(self._names, self._params, self._exposed):
                grad = p.grad
                if grad is None:
                    p.main_grad.zero_()
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

    def extra_repr(self) -> str:
        return (
            f"world_size={self.world_size}, params={len(self._params)}, buckets={len(self._buckets)}, "
            f"overlap_grad_reduce={self.config.overlap_grad_reduce}, reduce_scatter={self.config.reduce_scatter}"
        )


def _weak_hook(method: Callable[..., None], *bound: Any) -> Callable[..., None]:
    """``method(*bound, *args)`` through a weak reference to ``method``'s object (a no-op once it is gone)."""
    ref = weakref.WeakMethod(method)

    def hook(*args: Any) -> None:
        target = ref()
        if target is not None:
            target(*bound, *args)

    return hook


def _detach(handles: list[Any], params: list[nn.Parameter]) -> None:
    """Remove the hooks (emptying ``handles`` in place) and the attributes the wrapper set on ``params``."""
    for handle in handles:
        handle.remove()
    handles.clear()
    for p in params:
        for attr in ("main_grad", "grad_added_to_main_grad"):
            if hasattr(p, attr):
                delattr(p, attr)
