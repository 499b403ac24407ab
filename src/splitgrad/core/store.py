"""Deferred weight-gradient work: tasks, per-module stores, hooks and capture bundles.

A layer that splits its backward computes the input gradient in autograd's backward and *parks* the weight
gradient as a :class:`WgradTask` — a small closure over the saved operands (input activations and output
gradient) that, when run, writes the weight/bias gradients and then fires the owner's wgrad hooks.

Where a parked task goes:

* normally into the owner's :class:`WeightGradStore` (a FIFO; ``module.backward_dw()`` runs the oldest), or
* inside :func:`capture_wgrad`, into the yielded :class:`WgradBundle`, so a pipeline schedule can run the W
  step of one microbatch exactly, in any order relative to other microbatches.

Nothing here knows about modules, DDP or schedules: an owner is anything holding a store.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import warnings
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Sequence

import torch
from torch.utils.hooks import RemovableHandle

__all__ = [
    "WeightGradStore",
    "WgradBundle",
    "WgradHooks",
    "WgradTask",
    "active_bundle",
    "capture_wgrad",
]

logger = logging.getLogger(__name__)


class WgradHooks:
    """An ordered set of zero-argument callables fired after each completed weight-gradient task.

    ``register`` returns a :class:`torch.utils.hooks.RemovableHandle`, the same handle type as
    ``nn.Module.register_forward_hook``, so callers can ``handle.remove()`` (TE returns nothing).
    """

    def __init__(self) -> None:
        self._hooks: OrderedDict[int, Callable[[], None]] = OrderedDict()

    def register(self, hook: Callable[[], None]) -> RemovableHandle:
        if not callable(hook):
            raise TypeError(f"wgrad hook must be callable with no arguments, got {type(hook).__name__}")
        handle = RemovableHandle(self._hooks)
        self._hooks[handle.id] = hook
        return handle

    def fire(self) -> None:
        # Snapshot: a hook may remove itself (or another) while we iterate.
        for hook in list(self._hooks.values()):
            hook()

    def __len__(self) -> int:
        return len(self._hooks)


class WgradTask:
    """One backward's worth of deferred weight-gradient work for one owner.

    Args:
        compute: writes the gradients (``.grad`` or ``main_grad``); called exactly once.
        store: the owner's store; its hooks fire after ``compute`` and its outstanding count is kept.
        label: shown in errors and profiler ranges (usually the owner's name).
        saved: tensors ``compute`` reads; their version counters are recorded now and checked before
            running, so an in-place change between backward and ``backward_dw`` is an error, not a silently
            wrong gradient.
    """

    __slots__ = ("_compute", "_done", "_in_bundle", "_versions", "label", "store")

    def __init__(
        self,
        compute: Callable[[], None],
        *,
        store: WeightGradStore,
        label: str = "",
        saved: Sequence[torch.Tensor] = (),
    ) -> None:
        self._compute = compute
        self.store = store
        self.label = label or store.name
        self._versions = [(t, t._version) for t in saved]
        self._done = False
        self._in_bundle = False

    @property
    def done(self) -> bool:
        return self._done

    @property
    def saved_bytes(self) -> int:
        """Bytes of the distinct storages this task keeps alive until it runs (0 once it ran)."""
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t, _ in self._versions}
        return sum(storages.values())

    def run(self, *, fire_hooks: bool = True) -> None:
        """Compute and write the gradients, then fire the owner's wgrad hooks.

        Args:
            fire_hooks: ``False`` leaves hook firing to the caller (a graph capture records the gradient
                math only and fires the hooks itself after each replay).
        """
        if self._done:
            raise RuntimeError(
                f"wgrad task of {self.label!r} already ran; running it again would double-count"
            )
        for i, (tensor, version) in enumerate(self._versions):
            if tensor._version != version:
                raise RuntimeError(
                    f"wgrad task of {self.label!r}: saved tensor {i} (shape {tuple(tensor.shape)}) was modified "
                    f"in place after backward (version {version} -> {tensor._version}); its weight gradient "
                    "would be wrong"
                )
        # No grad mode: saved operands can be views of tensors that require grad (a view made inside backward
        # still does), and recording their W math would attach a grad_fn to `.grad` or `main_grad`.
        with torch.no_grad(), torch.profiler.record_function(f"splitgrad.wgrad:{self.label}"):
            self._compute()
        self._done = True
        # Drop operands as soon as possible: they are activation-sized.
        self._compute = _ran
        self._versions = []
        self.store._finished_elsewhere(self)
        if fire_hooks:
            self.store.hooks.fire()

    def __repr__(self) -> str:
        return f"WgradTask({self.label!r}, done={self._done})"


def _ran() -> None:
    raise RuntimeError("wgrad task already ran")


class WeightGradStore:
    """Per-owner FIFO of pending :class:`WgradTask` objects (TE's ``WeightGradStore`` name and role).

    Args:
        delay_wgrad_compute: whether the owner defers its weight gradient at all.
        name: owner name used in error messages.
    """

    def __init__(self, delay_wgrad_compute: bool = False, *, name: str = "") -> None:
        self._delay = bool(delay_wgrad_compute)
        self.name = name
        self.hooks = WgradHooks()
        self._queue: deque[WgradTask] = deque()
        # Tasks of this owner parked in capture bundles that have not run yet (still owed).
        self._captured = 0
        # Tasks held by other mechanisms (graph replays), declared with owe()/settle().
        self._owed = 0
        self._lock = threading.Lock()

    # TE-compatible switches.
    def delay_wgrad_compute(self) -> bool:
        return self._delay

    def enable_delay_wgrad_compute(self) -> None:
        self._delay = True

    def disable_delay_wgrad_compute(self) -> None:
        self._delay = False

    def defer(self, task: WgradTask) -> None:
        """Park ``task``: in the innermost active :func:`capture_wgrad` bundle if any, else in this queue."""
        bundle = active_bundle()
        with self._lock:
            if bundle is None:
                self._queue.append(task)
            else:
                self._captured += 1
        if bundle is not None:
            bundle._append(task)

    def put(self, task: WgradTask) -> None:
        """Alias of :meth:`defer` (TE's name)."""
        self.defer(task)

    def pop(self) -> WgradTask:
        """Remove and return the oldest queued task (FIFO); raises if none is queued."""
        with self._lock:
            if not self._queue:
                raise RuntimeError(f"{self.name or 'WeightGradStore'}: no pending weight-gradient work")
            return self._queue.popleft()

    def run_next(self) -> None:
        """Run the oldest queued task (one backward's worth)."""
        self.pop().run()

    def clear(self) -> int:
        """Drop queued tasks *without* running them (their gradients are lost); returns how many."""
        with self._lock:
            n = len(self._queue)
            self._queue.clear()
        if n:
            logger.warning("%s: discarded %d pending wgrad task(s)", self.name, n)
        return n

    def __len__(self) -> int:
        return len(self._queue)

    @property
    def captured(self) -> int:
        """Tasks of this owner sitting in capture bundles that have not run or been discarded."""
        return self._captured

    def _finished_elsewhere(self, task: WgradTask) -> None:
        # Called by every task after running; only bundle-held tasks are counted in `_captured`.
        if task._in_bundle:
            with self._lock:
                self._captured -= 1

    def _discarded(self, n: int) -> None:
        with self._lock:
            self._captured -= n

    @property
    def owed_elsewhere(self) -> int:
        """Tasks owed by other holders (e.g. a graphed callable's pending wgrad replay); see :meth:`owe`."""
        return self._owed

    def owe(self, n: int = 1) -> None:
        """Record ``n`` tasks of this owner held outside its queue and bundles (a captured wgrad graph
        waiting for its replay), so :func:`splitgrad.ensure_no_pending_wgrad` and the optimizer guard see it."""
        with self._lock:
            self._owed += n

    def settle(self, n: int = 1) -> None:
        """The counterpart of :meth:`owe`, once the work ran (or was given up on purpose)."""
        with self._lock:
            if n > self._owed:
                raise RuntimeError(
                    f"{self.name}: settle({n}) but only {self._owed} task(s) are owed elsewhere"
                )
            self._owed -= n

    def __getstate__(self) -> dict:
        # deepcopy / pickle of a module copies its store: only an idle one (pending work cannot be copied
        # without running it twice or losing it). The lock is recreated, not copied.
        if self._queue or self._captured or self._owed:
            raise RuntimeError(
                f"cannot copy or pickle {self.name or 'WeightGradStore'} with pending wgrad work "
                f"(pending={len(self._queue)}, in bundles={self._captured}, elsewhere={self._owed}); "
                "run backward_dw first"
            )
        return {k: v for k, v in self.__dict__.items() if k not in ("_lock", "_queue")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._queue = deque()
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return (
            f"WeightGradStore({self.name!r}, delay={self._delay}, pending={len(self._queue)}, "
            f"captured={self._captured})"
        )


class WgradBundle:
    """The wgrad tasks deferred by backward passes run inside one :func:`capture_wgrad` block.

    A bundle is one unit of W work (e.g. one microbatch of one pipeline stage). Bundles are independent:
    they may run in any order. Each task in it still belongs to its owner, whose hooks fire when it runs.
    """

    def __init__(self) -> None:
        self._tasks: list[WgradTask] = []
        self._state = "open"  # open -> closed -> ran | discarded
        self._lock = threading.Lock()

    def _append(self, task: WgradTask) -> None:
        task._in_bundle = True
        with self._lock:
            if self._state not in ("open", "closed"):
                raise RuntimeError(f"cannot add wgrad work to a bundle that was already {self._state}")
            self._tasks.append(task)

    def __len__(self) -> int:
        return len(self._tasks)

    @property
    def tasks(self) -> tuple[WgradTask, ...]:
        return tuple(self._tasks)

    def saved_bytes(self) -> int:
        """Bytes the bundle's unrun tasks keep alive (the activation memory held between B and W)."""
        storages: dict[int, int] = {}
        for task in self._tasks:
            for t, _ in task._versions:
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return sum(storages.values())

    @property
    def pending(self) -> bool:
        """True while the bundle holds tasks that neither ran nor were discarded."""
        return self._state in ("open", "closed") and any(not t.done for t in self._tasks)

    def run(self) -> int:
        """Run every task in deferral order (writing gradients, firing hooks); returns how many ran."""
        if self._state in ("ran", "discarded"):
            raise RuntimeError(f"wgrad bundle was already {self._state}; running it again would double-count")
        ran = 0
        for task in self._tasks:
            if not task.done:
                task.run()
                ran += 1
        self._state = "ran"
        return ran

    def discard(self) -> int:
        """Give up the bundle's work on purpose (its gradients are lost); returns how many were dropped."""
        if self._state in ("ran", "discarded"):
            return 0
        left = [t for t in self._tasks if not t.done]
        for store in {id(t.store): t.store for t in left}.values():
            store._discarded(sum(1 for t in left if t.store is store))
        self._state = "discarded"
        return len(left)

    def __del__(self) -> None:
        if getattr(self, "_state", "ran") in ("open", "closed") and any(not t.done for t in self._tasks):
            warnings.warn(
                f"a wgrad bundle with {sum(not t.done for t in self._tasks)} unrun task(s) was garbage "
                "collected: those weight gradients are lost (call bundle.run() or bundle.discard())",
                RuntimeWarning,
                stacklevel=1,
            )

    def __repr__(self) -> str:
        return f"WgradBundle(tasks={len(self._tasks)}, state={self._state})"


class _CaptureStack:
    """Process-wide stack of open capture bundles.

    Process-wide on purpose (an exception to "no module-level state"): CUDA backward runs on autograd's own
    device threads, which inherit neither thread-locals nor contextvars from the thread that called
    ``loss.backward()``, so a per-thread stack would silently miss tasks deferred there.
    """

    def __init__(self) -> None:
        self._stack: list[WgradBundle] = []
        self._lock = threading.Lock()

    def push(self, bundle: WgradBundle) -> None:
        with self._lock:
            self._stack.append(bundle)

    def pop(self, bundle: WgradBundle) -> None:
        with self._lock:
            on_top = bool(self._stack) and self._stack[-1] is bundle
            # Remove it either way, so one misuse cannot leave a stale bundle swallowing all later work.
            self._stack[:] = [b for b in self._stack if b is not bundle]
        if not on_top:
            raise RuntimeError("capture_wgrad blocks must be exited in the reverse order they were entered")

    def top(self) -> WgradBundle | None:
        with self._lock:
            return self._stack[-1] if self._stack else None


_CAPTURES = _CaptureStack()


def active_bundle() -> WgradBundle | None:
    """The innermost open :func:`capture_wgrad` bundle, or None."""
    return _CAPTURES.top()


@contextlib.contextmanager
def capture_wgrad() -> Iterator[WgradBundle]:
    """Collect every wgrad task deferred inside the block into a bundle instead of the module stores.

    Example::

        with splitgrad.capture_wgrad() as w0:
            loss0.backward()           # dgrad now; wgrad parked in w0
        ...
        w0.run()                       # weight gradients of microbatch 0, hooks fire

    Yields:
        The :class:`WgradBundle`; it stays valid after the block and can be run at any later time.
    """
    bundle = WgradBundle()
    _CAPTURES.push(bundle)
    try:
        yield bundle
    finally:
        _CAPTURES.pop(bundle)
        bundle._state = "closed" if bundle._state == "open" else bundle._state
