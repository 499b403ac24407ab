"""Per-owner stores of deferred weight-gradient work, their hooks, and the one account of what is owed.

A layer that splits its backward computes the input gradient in autograd's backward and *parks* the weight
gradient as a :class:`~splitgrad.core.task.WgradTask`. A parked task is owed until it runs (or is discarded on
purpose), and it is owed in exactly one of three places, all counted by the owner's store:

* **queued** in the owner's :class:`WeightGradStore` (a FIFO; ``module.backward_dw()`` runs the oldest);
* **in a bundle**: parked inside :func:`~splitgrad.capture_wgrad`, held by a
  :class:`~splitgrad.core.bundle.WgradBundle` under a :class:`WgradClaim` on the store;
* **in a graph replay**: a captured wgrad graph waiting for its replay, declared with :meth:`WeightGradStore.owe`.

:attr:`WeightGradStore.outstanding` reports the three and their total; every claim is settled exactly once
(settling twice raises), so nothing is lost silently and nothing is counted twice.

Nothing here knows about modules, DDP or schedules: an owner is anything holding a store.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from torch.utils.hooks import RemovableHandle

from .capture_stack import CAPTURES

if TYPE_CHECKING:
    from .task import WgradTask

__all__ = ["Outstanding", "WeightGradStore", "WgradClaim", "WgradHooks"]

logger = logging.getLogger(__name__)

#: Where owed work can sit besides the queue (the keys of a store's claim counts).
CLAIM_KINDS = ("bundle", "graph")


class WgradHooks:
    """An ordered set of callables, fired in registration order with the arguments :meth:`fire` is given
    (none for the hooks fired after each completed weight-gradient task).

    ``register`` returns a :class:`torch.utils.hooks.RemovableHandle`, the same handle type as
    ``nn.Module.register_forward_hook``, so callers can ``handle.remove()`` (TE returns nothing).
    """

    def __init__(self) -> None:
        self._hooks: OrderedDict[int, Callable[[], None]] = OrderedDict()

    def register(self, hook: Callable[..., None]) -> RemovableHandle:
        if not callable(hook):
            raise TypeError(f"wgrad hook must be callable, got {type(hook).__name__}")
        handle = RemovableHandle(self._hooks)
        self._hooks[handle.id] = hook
        return handle

    def fire(self, *args: object) -> None:
        # Snapshot: a hook may remove itself (or another) while we iterate.
        for hook in list(self._hooks.values()):
            hook(*args)

    def __len__(self) -> int:
        return len(self._hooks)

    def __iter__(self):
        # A snapshot, for the same reason as fire().
        return iter(list(self._hooks.values()))


@dataclasses.dataclass(frozen=True, slots=True)
class Outstanding:
    """What one store (or a whole model) still owes, by where the work sits."""

    #: Tasks waiting in stores' FIFO queues (what TE's ``WeightGradStore`` holds; ``backward_dw`` runs them).
    queued: int = 0
    #: Tasks held by :func:`~splitgrad.capture_wgrad` bundles that neither ran nor were discarded.
    in_bundles: int = 0
    #: Captured wgrad graphs waiting for their replay (:meth:`WeightGradStore.owe`).
    in_graphs: int = 0

    @property
    def total(self) -> int:
        """Everything owed."""
        return self.queued + self.in_bundles + self.in_graphs

    def __add__(self, other: Outstanding) -> Outstanding:
        return Outstanding(
            self.queued + other.queued, self.in_bundles + other.in_bundles, self.in_graphs + other.in_graphs
        )

    def __bool__(self) -> bool:
        return self.total > 0

    def describe(self) -> str:
        """``"queued=1, in bundles=2"`` style summary of the non-zero parts (``"nothing"`` when idle)."""
        parts = [("queued", self.queued), ("in bundles", self.in_bundles), ("in graphs", self.in_graphs)]
        return ", ".join(f"{k}={v}" for k, v in parts if v) or "nothing"


class WgradClaim:
    """One unit of work owed to a store outside its queue; :meth:`settle` it exactly once.

    Made by :meth:`WeightGradStore.owe` (graph replays) and by bundles for each task they hold.
    """

    __slots__ = ("_settled", "kind", "store")

    def __init__(self, store: WeightGradStore, kind: str) -> None:
        self.store = store
        self.kind = kind
        self._settled = False

    @property
    def settled(self) -> bool:
        return self._settled

    def settle(self) -> None:
        """The work ran (or was given up on purpose); raises if this claim was settled already."""
        with self.store._lock:
            if self._settled:
                raise RuntimeError(
                    f"{self.store.name or 'WeightGradStore'}: a {self.kind} claim was settled twice; the owed "
                    "work would be counted twice"
                )
            self._settled = True
            self.store._claims[self.kind] -= 1

    def __repr__(self) -> str:
        return f"WgradClaim({self.store.name!r}, kind={self.kind!r}, settled={self._settled})"


class WeightGradStore:
    """Per-owner FIFO of pending :class:`~splitgrad.core.task.WgradTask` objects (TE's name and role), and the
    owner's account of everything it is owed (:attr:`outstanding`).

    Args:
        delay_wgrad_compute: whether the owner defers its weight gradient at all.
        name: owner name used in error messages.
    """

    def __init__(self, delay_wgrad_compute: bool = False, *, name: str = "") -> None:
        self._delay = bool(delay_wgrad_compute)
        self.name = name
        self.hooks = WgradHooks()
        # Context-manager factories entered around every task's compute (after its checks, before any write):
        # a sharding wrapper uses one to put the parameter the task writes back on the owner (FSDP2 glue).
        self.compute_contexts = WgradHooks()
        #: ``listener(task)`` for every task :meth:`defer` queues (not one a capture bundle takes): a scheduler
        #: that runs weight-gradient work on its own clock takes it from here (DeepSeek's DualPipe, through
        #: splitgrad.integrations.dualpipe). The task stays queued, and owed, until it runs.
        self.on_queued = WgradHooks()
        self._queue: deque[WgradTask] = deque()
        self._claims = dict.fromkeys(CLAIM_KINDS, 0)
        # Reentrant: a bundle garbage-collected while this thread holds the lock hands its tasks back here.
        self._lock = threading.RLock()

    # TE-compatible switches.
    def delay_wgrad_compute(self) -> bool:
        return self._delay

    def enable_delay_wgrad_compute(self) -> None:
        self._delay = True

    def disable_delay_wgrad_compute(self) -> None:
        self._delay = False

    # -- the account ------------------------------------------------------------------------------------
    @property
    def outstanding(self) -> Outstanding:
        """Work owed by this store's owner: queued, in bundles, in graph replays (and the total)."""
        with self._lock:
            return Outstanding(len(self._queue), self._claims["bundle"], self._claims["graph"])

    @property
    def captured(self) -> int:
        """Tasks of this owner sitting in capture bundles (``outstanding.in_bundles``)."""
        return self._claims["bundle"]

    def owe(self) -> WgradClaim:
        """Record one unit of work held outside the queue and bundles (a captured wgrad graph awaiting its
        replay), so :func:`splitgrad.ensure_no_pending_wgrad` and the optimizer guard see it.

        Returns:
            The claim; call its ``settle()`` once the work ran (or was given up on purpose).
        """
        return self._claim("graph")

    def _claim(self, kind: str) -> WgradClaim:
        with self._lock:
            self._claims[kind] += 1
        return WgradClaim(self, kind)

    # -- the queue --------------------------------------------------------------------------------------
    def defer(self, task: WgradTask) -> None:
        """Park ``task``: in the innermost active :func:`~splitgrad.capture_wgrad` bundle if any, else queue it
        (then :attr:`on_queued` is told)."""
        bundle = CAPTURES.top()  # the innermost open capture_wgrad bundle, if any
        if bundle is None:
            self._enqueue(task)
            self.on_queued.fire(task)
        else:
            bundle._append(task)

    def put(self, task: WgradTask) -> None:
        """Alias of :meth:`defer` (TE's name)."""
        self.defer(task)

    def _enqueue(self, task: WgradTask) -> None:
        with self._lock:
            task._holder = self
            self._queue.append(task)

    def pop(self) -> WgradTask:
        """Remove and return the oldest queued task (FIFO): the caller now owns it and must run it."""
        with self._lock:
            if not self._queue:
                raise RuntimeError(f"{self.name or 'WeightGradStore'}: no pending weight-gradient work")
            task = self._queue.popleft()
            task._holder = None
            return task

    def run_next(self) -> None:
        """Run the oldest queued task (one backward's worth).

        The task leaves the queue only once it ran: if it raises (a missing ``main_grad``, an operand modified
        in place), it stays queued and owed, so fixing the cause and calling again runs it; :meth:`clear`
        drops it on purpose.
        """
        with self._lock:
            if not self._queue:
                raise RuntimeError(f"{self.name or 'WeightGradStore'}: no pending weight-gradient work")
            task = self._queue[0]
        task.run()

    def _settle_queued(self, task: WgradTask) -> None:
        # Called by a queued task once it ran; usually the head of the queue.
        with self._lock:
            if self._queue and self._queue[0] is task:
                self._queue.popleft()
            else:
                self._queue.remove(task)

    def clear(self) -> int:
        """Drop queued tasks *without* running them (their gradients are lost); returns how many."""
        with self._lock:
            tasks = list(self._queue)
            self._queue.clear()
        for task in tasks:
            task._mark_discarded()
        if tasks:
            logger.warning("%s: discarded %d pending wgrad task(s)", self.name, len(tasks))
        return len(tasks)

    def __len__(self) -> int:
        """Queued tasks only (TE's meaning); :attr:`outstanding` counts bundles and graph replays too."""
        return len(self._queue)

    def __getstate__(self) -> dict:
        # deepcopy / pickle of a module copies its store: only an idle one (pending work cannot be copied
        # without running it twice or losing it). The lock is recreated, not copied.
        owed = self.outstanding
        if owed:
            raise RuntimeError(
                f"cannot copy or pickle {self.name or 'WeightGradStore'} with pending wgrad work "
                f"({owed.describe()}); run backward_dw first"
            )
        return {k: v for k, v in self.__dict__.items() if k not in ("_lock", "_queue")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._queue = deque()
        self._lock = threading.RLock()

    def __repr__(self) -> str:
        return f"WeightGradStore({self.name!r}, delay={self._delay}, owed: {self.outstanding.describe()})"
