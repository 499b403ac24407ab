"""How long this thread waited on a run queue (runnable, not running): Linux's per-thread schedstat.

On a machine with as many busy threads as cores, time between a pipeline's actions is not only the runtime's
own CPU: a rank's thread is also descheduled while gloo's transport threads (its own or the peer's) copy
messages. ``/proc/thread-self/schedstat`` counts that time (field 2, nanoseconds), so a diagnostic can split
an idle gap into CPU, run-queue wait and the rest (sleeping in a wait).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

__all__ = ["HandlerRunQueue", "run_queue_seconds"]


def run_queue_seconds() -> float | None:
    """Seconds the calling thread has spent runnable but not running, or None where the kernel does not say."""
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/schedstat") as f:
            return int(f.read().split()[1]) * 1e-9
    except (OSError, IndexError, ValueError):
        return None


class HandlerRunQueue:
    """Run-queue wait of a pipeline runtime's thread inside its action handlers, and over whole steps.

    Wraps every entry of the runtime's kind -> handler table (a diagnostic: it costs two small file reads per
    action). ``inside`` accumulates the wait during handlers; :meth:`step` times one step's total.
    """

    def __init__(self, runtime: Any) -> None:
        self.available = run_queue_seconds() is not None
        self.inside = 0.0
        if self.available:
            table = runtime.handlers  # the runtime's kind -> handler table
            for kind, handler in list(table.items()):
                table[kind] = self._wrap(handler)

    def _wrap(self, handler: Callable[..., None]) -> Callable[..., None]:
        def timed(*args: Any) -> None:
            before = run_queue_seconds()
            try:
                handler(*args)
            finally:
                self.inside += run_queue_seconds() - before

        return timed

    def step(self, run: Callable[[], Any]) -> tuple[Any, float, float]:
        """``(run(), run-queue seconds of the step, of which inside handlers)``; zeros where unavailable."""
        if not self.available:
            return run(), 0.0, 0.0
        self.inside, before = 0.0, run_queue_seconds()
        result = run()
        return result, run_queue_seconds() - before, self.inside
