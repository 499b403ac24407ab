"""One computing thread at a time in an overlapped pair: the threads hand the core over only at their waits.

In :func:`~splitgrad.parallel.expert.overlapped_forward_backward` the forward and the backward part share the
rank's core. Left to the OS, two runnable threads are time-sliced every few milliseconds (hundreds of
involuntary context switches per pair, each refilling the caches with the other part's working set). With a
baton, a part computes only while it holds it and gives it up exactly while it waits for an exchange: the core
switches parts at the exchanges (a few dozen voluntary switches per pair) and never in the middle of a GEMM.
A holder is always computing or finishing (every wait releases it), so the baton cannot deadlock the pair.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator

__all__ = ["ComputeBaton"]

logger = logging.getLogger(__name__)


class ComputeBaton:
    """A lock that the thread holding it releases around its exchange waits (:meth:`released`).

    ``released()`` on a thread that does not hold the baton is a no-op, so a layer that captured the baton of
    a pair (e.g. an autograd node's backward run after the pair) waits as usual.
    """

    def __init__(self, log: list | None = None) -> None:
        self._lock = threading.Lock()
        self._owner: int | None = None
        #: Times a thread gave the baton up to wait (diagnostics).
        self.handoffs = 0
        #: When a list: ``(start, end)`` (``time.perf_counter()`` seconds) of each wait to take the baton back
        #: after an exchange wait; the other part computed meanwhile (diagnostics).
        self.log = log

    def acquire(self) -> None:
        """Block until the calling thread holds the baton (it waits while the other part computes)."""
        self._lock.acquire()
        self._owner = threading.get_ident()

    def release(self) -> None:
        """Give the baton up; a no-op on a thread that does not hold it."""
        if self._owner != threading.get_ident():
            return
        self._owner = None
        self._lock.release()

    def held(self) -> bool:
        """Whether the calling thread holds the baton."""
        return self._owner == threading.get_ident()

    @contextlib.contextmanager
    def released(self) -> Iterator[None]:
        """Release the baton for the block (a wait) if this thread holds it, and take it back afterwards."""
        if not self.held():
            yield
            return
        self.handoffs += 1
        self.release()
        try:
            yield
        finally:
            start = time.perf_counter()
            self.acquire()
            if self.log is not None:
                self.log.append((start, time.perf_counter()))
