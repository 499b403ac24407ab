"""Capture bundles: the wgrad tasks of the backward passes run inside one :func:`capture_wgrad` block.

A bundle is one unit of W work (e.g. one microbatch of one pipeline stage) that a schedule runs exactly, in any
order relative to other bundles. Each task it holds is a claim on its owner's store (counted in
``store.outstanding.in_bundles``) settled exactly once: when the task runs, or when the bundle is discarded.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import warnings
from collections.abc import Iterator

from .capture_stack import CAPTURES as _CAPTURES
from .task import WgradTask

__all__ = ["WgradBundle", "active_bundle", "capture_wgrad"]

logger = logging.getLogger(__name__)


class WgradBundle:
    """The wgrad tasks deferred by backward passes run inside one :func:`capture_wgrad` block.

    Bundles are independent: they may run in any order. Each task in it still belongs to its owner, whose
    hooks fire when it runs. A task that raises stays in the bundle and owed: fix the cause and ``run()``
    again (tasks that already ran are not repeated), or ``discard()``.

    Args:
        defer_requested: see :func:`capture_wgrad`.
    """

    def __init__(self, *, defer_requested: bool = False) -> None:
        self._tasks: list[WgradTask] = []
        self._state = "open"  # open -> closed -> ran | discarded; "running" while run() is in progress
        self._lock = threading.Lock()
        self.defer_requested = bool(defer_requested)

    def _append(self, task: WgradTask) -> None:
        with self._lock:
            if self._state not in ("open", "closed"):
                raise RuntimeError(f"cannot add wgrad work to a bundle that is {self._state}")
            task._holder = task.store._claim("bundle")
            self._tasks.append(task)

    def __len__(self) -> int:
        return len(self._tasks)

    @property
    def tasks(self) -> tuple[WgradTask, ...]:
        return tuple(self._tasks)

    @property
    def outstanding(self) -> int:
        """Tasks of this bundle still owed (neither ran nor discarded)."""
        return sum(t.owed for t in self._tasks)

    @property
    def pending(self) -> bool:
        """True while the bundle holds owed tasks (``outstanding > 0``)."""
        return self.outstanding > 0

    def saved_bytes(self) -> int:
        """Bytes the bundle's unrun tasks keep alive (the activation memory held between B and W)."""
        storages: dict[int, int] = {}
        for task in self._tasks:
            for t, _ in task._versions:
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return sum(storages.values())

    def run(self) -> int:
        """Run every owed task in deferral order (writing gradients, firing hooks); returns how many ran.

        Raises:
            RuntimeError: the bundle already ran, was discarded, or is running in another thread; or a task
                failed (it and the tasks after it stay owed; ``run()`` again after fixing the cause).
        """
        with self._lock:
            if self._state in ("ran", "discarded", "running"):
                raise RuntimeError(
                    f"wgrad bundle {'is' if self._state == 'running' else 'was already'} {self._state}; "
                    "running it again would double-count"
                )
            before, self._state = self._state, "running"
        ran = 0
        try:
            for task in self._tasks:
                if task.owed:
                    task.run()
                    ran += 1
        except BaseException:
            with self._lock:
                self._state = before
            raise
        with self._lock:
            self._state = "ran"
        return ran

    def discard(self) -> int:
        """Give up the bundle's work on purpose (its gradients are lost); returns how many were dropped."""
        with self._lock:
            if self._state == "running":
                raise RuntimeError("wgrad bundle is running; it cannot be discarded now")
            if self._state in ("ran", "discarded"):
                return 0
            self._state = "discarded"
        left = [t for t in self._tasks if t.owed]
        for task in left:
            task._mark_discarded()
        return len(left)

    def __del__(self) -> None:
        tasks = [t for t in getattr(self, "_tasks", ()) if t.owed]
        if not tasks:
            return
        # Nobody can run or discard this bundle any more, but its tasks can still run: hand them to their
        # owners' queues, where splitgrad.backward_dw(model) runs them (or splitgrad.discard_wgrad drops them).
        for task in tasks:
            holder, task._holder = task._holder, None
            holder.settle()
            task.store._enqueue(task)
        warnings.warn(
            f"a wgrad bundle with {len(tasks)} unrun task(s) was garbage collected; they were moved to their "
            "layers' queues: run splitgrad.backward_dw(model) to write those weight gradients, or "
            "splitgrad.discard_wgrad(model) to give them up",
            RuntimeWarning,
            stacklevel=1,
        )

    def __repr__(self) -> str:
        return f"WgradBundle(tasks={len(self._tasks)}, outstanding={self.outstanding}, state={self._state})"


def active_bundle() -> WgradBundle | None:
    """The innermost open :func:`capture_wgrad` bundle, or None."""
    return _CAPTURES.top()


@contextlib.contextmanager
def capture_wgrad(*, defer_requested: bool = False) -> Iterator[WgradBundle]:
    """Collect every wgrad task deferred inside the block into a bundle instead of the module stores.

    Example::

        with splitgrad.capture_wgrad() as w0:
            loss0.backward()           # dgrad now; wgrad parked in w0
        ...
        w0.run()                       # weight gradients of microbatch 0, hooks fire

    Args:
        defer_requested: also defer the weight gradients that ``torch.autograd.grad`` asks for (it then gets
            None for them). Off by default, where ``autograd.grad`` w.r.t. a deferred weight computes it at
            once, as plain PyTorch does. Graph capture turns it on: there the wgrad graph writes them.

    Yields:
        The :class:`WgradBundle`; it stays valid after the block and can be run at any later time.
    """
    bundle = WgradBundle(defer_requested=defer_requested)
    _CAPTURES.push(bundle)
    try:
        yield bundle
    finally:
        _CAPTURES.pop(bundle)
        with bundle._lock:
            if bundle._state == "open":
                bundle._state = "closed"
