"""Data parallelism driven by gradient readiness, deferred weight gradients included.

With ``delay_wgrad_compute`` a weight gradient does not exist when autograd's ``AccumulateGrad`` runs, so a
DDP listening to autograd reduces nothing (or garbage). This wrapper learns that a gradient is ready from two
sources and treats them alike:

* parameters whose gradient flows through autograd: a post-accumulate-grad hook;
* parameters with ``skip_backward_post_hook`` (their module writes the gradient itself, in ``backward_dw`` or,
  when fused, inside backward): the owning module's/op's ``register_wgrad_accumulation_and_reduce_hooks``.

Either hook adds any ``.grad`` into ``param.main_grad`` (a view into a contiguous per-dtype buffer), drops
``.grad``, and records one contribution. A bucket whose parameters have all their expected contributions
(see :mod:`splitgrad.parallel.data.readiness`) starts its asynchronous collective at once, overlapping the rest of
backward / ``backward_dw``; collectives are issued in bucket order on every rank, so ranks whose buckets
complete in different orders still pair them correctly. ``finish_grad_sync()`` waits for all of them.

This file is the wrapper: construction, the forward, the hooks' lifetime, the group, closing. The gradient
sync itself (buffers, buckets, readiness, zeroing) is a :class:`~splitgrad.parallel.data.grad_sync.GradSync`
the wrapper owns and forwards to.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ...core import ensure_no_pending_wgrad
from ...core.steps import Steps, child_steps
from ...distributed.group_ref import GroupRef
from ...distributed.wait import bounded_wait
from .buckets import Bucket, GradBuffer
from .config import DDPConfig
from .grad_sync import GradSync
from .hooks import detach, install_hooks

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
        # The group is never held (distributed/group_ref.py): a reference held past destroy_process_group()
        # keeps the group alive until interpreter exit, where gloo may abort. The default group (also passed
        # explicitly, `process_group=dist.group.WORLD`, the common spelling) is looked up at each use, another
        # weakly.
        group = GroupRef(process_group, owner="DistributedDataParallel.process_group")
        self.rank = dist.get_rank(group.get())
        self.world_size = dist.get_world_size(group.get())
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
        self.grad_sync = GradSync(
            list(reversed(named)), config=self.config, group=group, rank=self.rank, world_size=self.world_size
        )
        """The gradient sync this wrapper drives (buffers, buckets, readiness; see :class:`GradSync`)."""

        # Hooks hold the sync weakly (see splitgrad.parallel.data.hooks): a strong cycle through C++ would
        # keep it, and its process group, alive past destroy_process_group().
        sync = self.grad_sync
        self._handles = install_hooks(
            module,
            sync.params,
            sync.index_of,
            on_autograd_grad=sync.on_autograd_grad,
            on_wgrad=sync.on_wgrad,
        )
        self._finalizer = weakref.finalize(self, detach, self._handles, sync.params)
        self._finalizer.atexit = False
        if self.config.broadcast_at_init:
            self.broadcast_params()
        logger.debug("%s", self)

    # -- public API ---------------------------------------------------------------------------------------
    @property
    def process_group(self) -> dist.ProcessGroup | None:
        """The data-parallel group (the default group, looked up now, when none was given); None once closed."""
        return None if self._closed else self.grad_sync.process_group

    @property
    def buckets(self) -> tuple[Bucket, ...]:
        """The buckets, in the order their collectives are issued."""
        return tuple(self.grad_sync.buckets)

    @property
    def grad_buffers(self) -> tuple[GradBuffer, ...]:
        """The contiguous gradient buffers, one per ``(device, dtype)``."""
        return tuple(self.grad_sync.buffers)

    @property
    def launch_order(self) -> list[int]:
        """Bucket indices in the order their collectives were issued this step."""
        return self.grad_sync.launch_order

    @property
    def last_launch_order(self) -> list[int]:
        """:attr:`launch_order` of the last finished step."""
        return self.grad_sync.last_launch_order

    @property
    def last_launched_early(self) -> int:
        """Of the last finished step: buckets already reducing when :meth:`finish_grad_sync` was called."""
        return self.grad_sync.last_launched_early

    @property
    def grad_divisor(self) -> int:
        """The reduced gradient is the sum over the group divided by this (default: the group's size)."""
        return self.grad_sync.grad_divisor

    @grad_divisor.setter
    def grad_divisor(self, value: int) -> None:
        self.grad_sync.grad_divisor = value

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
        self.grad_sync.begin_forward()

    def expect_backward(self, outputs: Any) -> None:
        """Count the gradient contributions that backward over ``outputs`` (one forward's result) will bring.

        :meth:`forward` calls it; a wrapper that runs the module once for several data-parallel wrappers (one
        per parameter group, e.g. expert and dense parameters) calls :meth:`begin_forward` and this on each.
        """
        self.grad_sync.expect_backward(outputs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally: contributions arriving inside the block start no collective.

        Use it for every microbatch but the last; contributions of all microbatches are counted, so a
        deferred weight gradient of an earlier microbatch that runs after the block (zero-bubble schedules)
        still delays its bucket until it has arrived.
        """
        with self.grad_sync.no_sync():
            yield

    def finish_grad_sync(self) -> None:
        """Issue the collectives not started yet, wait for all, leave the average in every ``main_grad``.

        Raises:
            RuntimeError: inside :meth:`no_sync`; while weight-gradient work is pending; when a parameter
                received no gradient this step (unless ``allow_unused_parameters``); when a collective fails
                or times out.
        """
        self._check_open("finish_grad_sync()")
        if not self.grad_sync.syncing:
            raise RuntimeError("DistributedDataParallel.finish_grad_sync() called inside no_sync()")
        ensure_no_pending_wgrad(self.module, what="DistributedDataParallel.finish_grad_sync()")
        self.grad_sync.finish()

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
        self.grad_sync.zero()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Same as :meth:`zero_grad_buffer` (``set_to_none`` is accepted for ``nn.Module`` compatibility)."""
        del set_to_none
        self.zero_grad_buffer()

    def local_grad_shards(self) -> list[torch.Tensor]:
        """Per bucket, the ``(numel / world_size,)`` shard this rank owns (averaged after a reduce-scatter)."""
        return [b.shard(self.rank, self.world_size) for b in self.grad_sync.buckets]

    def broadcast_params(self) -> None:
        """Copy parameters and buffers of the group's rank 0 to every rank."""
        self._check_open("broadcast_params()")
        group = self.process_group
        src = dist.get_global_rank(group, 0)
        tensors = [p.detach() for p in self.module.parameters()] + [b.detach() for b in self.module.buffers()]
        works = [dist.broadcast(t, src=src, group=group, async_op=True) for t in tensors]
        for work in works:
            bounded_wait(
                work,
                f"DistributedDataParallel.broadcast_params: broadcast from rank {src}",
                timeout=self.config.wait_timeout,
                group=group,
                hint="did every rank construct the wrapper / call broadcast_params()?",
            )

    def remove_hooks(self) -> None:
        """Detach from the module: remove every hook and the ``main_grad`` attributes."""
        detach(self._handles, self.grad_sync.params)
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
        first_error = self.grad_sync.wait_in_flight()
        self.remove_hooks()
        self.grad_sync.release()
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
            f"world_size={self.world_size}, params={len(self.grad_sync.params)}, "
            f"buckets={len(self.grad_sync.buckets)}, overlap_grad_reduce={self.config.overlap_grad_reduce}, "
            f"reduce_scatter={self.config.reduce_scatter}"
        )
