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
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..core import ensure_no_pending_wgrad
from ..core.steps import Steps, child_steps
from ..distributed.group_ref import GroupRef
from .buckets import Bucket, GradBuffer, build_buffers
from .config import DDPConfig
from .ddp_hooks import detach, install_hooks
from .grad_sync import GradSync
from .readiness import StepCounts, count_contributions

__all__ = ["DistributedDataParallel"]

logger = logging.getLogger(__name__)


class DistributedDataParallel(GradSync, nn.Module):
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
        # The group is never held (group_ref.py): a reference held past destroy_process_group() keeps the
        # group alive until interpreter exit, where gloo may abort. The default group (also passed explicitly,
        # `process_group=dist.group.WORLD`, the common spelling) is looked up at each use, another weakly.
        self._group: GroupRef | None = GroupRef(process_group, owner="DistributedDataParallel.process_group")
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
            first_bucket_size=self.config.resolved_first_bucket_size,
            grad_dtype_for={p.dtype: self.config.grad_dtype(p.dtype) for p in self._params},
            world_size=self.world_size,
        )
        bucket_of = [0] * len(self._params)
        for bucket in self._buckets:
            for p in bucket.params:
                bucket_of[self._index_of[id(p)]] = bucket.index
        self._counts = StepCounts(bucket_of, len(self._buckets))
        #: Per parameter: its slice already holds this step's gradient divided by grad_divisor.
        self._predivided = [False] * len(self._params)
        #: Per parameter: its slice counts as zero but was not zeroed yet (see GradSync.zero_grad_buffer).
        self._pending_zero = [False] * len(self._params)
        #: Buffer versions at a lazy zero_grad_buffer(), checked (once) by the next forward; None: not watching.
        self._stale_watch: list[int] | None = None
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

        # Hooks hold the wrapper weakly (see splitgrad.parallel.ddp_hooks): a strong cycle through C++ would
        # keep the wrapper, and its process group, alive past destroy_process_group().
        self._handles = install_hooks(
            module,
            self._params,
            self._index_of,
            on_autograd_grad=self._on_autograd_grad,
            on_wgrad=self._on_wgrad,
        )
        self._finalizer = weakref.finalize(self, detach, self._handles, self._params)
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
        return None if self._group is None else self._group.get()

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

    def forward_steps(self, *args: Any, **kwargs: Any) -> Steps:
        """:meth:`forward` as steps: the module's, when it has any (see :mod:`splitgrad.core.steps`)."""
        self.begin_forward()
        out = yield from child_steps(self.module, *args, **kwargs)
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
        if self._stale_watch is not None:
            self._check_stale_watch()
        if self._grads_exposed:
            self._take_back_grads()

    def expect_backward(self, outputs: Any) -> None:
        """Count the gradient contributions that backward over ``outputs`` (one forward's result) will bring.

        :meth:`forward` calls it; a wrapper that runs the module once for several data-parallel wrappers (one
        per parameter group, e.g. expert and dense parameters) calls :meth:`begin_forward` and this on each.
        """
        if torch.is_grad_enabled():
            skip = [bool(getattr(p, "skip_backward_post_hook", False)) for p in self._params]
            self._zero_pending_written_by_layers(skip)
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

    def remove_hooks(self) -> None:
        """Detach from the module: remove every hook and the ``main_grad`` attributes."""
        detach(self._handles, self._params)
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

    def extra_repr(self) -> str:
        return (
            f"world_size={self.world_size}, params={len(self._params)}, buckets={len(self._buckets)}, "
            f"overlap_grad_reduce={self.config.overlap_grad_reduce}, reduce_scatter={self.config.reduce_scatter}"
        )
