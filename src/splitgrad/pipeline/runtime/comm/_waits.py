"""Bounded waits of one rank's pipeline traffic: every wait has a deadline and says whom it waited for.

A peer that crashed or hangs must not hang this rank: each wait goes through
:func:`splitgrad.distributed.wait.bounded_wait` (the one bounded wait of the library), so a timeout or a failed
transfer becomes a ``RuntimeError`` naming this pipeline rank (and its global rank), what it waited for and for
which action, and the limit. This class adds what only the pipeline needs: a deadline shared by several waits
and the timeline's record of each wait. The transport waits its messages here; the runtime its step barrier
and loss broadcast.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch.distributed as dist

from ....distributed.wait import bounded_wait

__all__ = ["BoundedWaits"]

# A pipeline wait fails when the peer crashed (its own error says why) or stalls (it is killed by the launcher).
_PEER_HINT = "did that rank crash or stall? its own error, if any, says why"


class BoundedWaits:
    """Waits of one pipeline rank, each at most ``timeout`` seconds.

    Args:
        rank: this rank's index in the schedule.
        global_rank: its rank in the default group (named in errors when it differs).
        timeout: seconds any single wait may take.
        on_wait: ``on_wait(label, start, end)`` called after each labelled wait (timeline recording).
    """

    __slots__ = ("_on_wait", "global_rank", "rank", "timeout")

    def __init__(
        self,
        rank: int,
        global_rank: int,
        timeout: float,
        on_wait: Callable[[str, float, float], None] | None = None,
    ) -> None:
        self.rank = rank
        self.global_rank = global_rank
        self.timeout = float(timeout)
        self._on_wait = on_wait

    def who(self) -> str:
        """``"pipeline rank 1"``, with ``" (global rank 5)"`` where the two differ."""
        own = "" if self.global_rank == self.rank else f" (global rank {self.global_rank})"
        return f"pipeline rank {self.rank}{own}"

    def wait(
        self,
        work: dist.Work | None,
        what: str,
        *,
        deadline: float | None = None,
        label: str | None = None,
    ) -> None:
        """Wait for ``work`` at most ``timeout`` seconds (or until ``deadline``, a ``time.monotonic`` value).

        Args:
            work: what was posted.
            what: whom this rank waits for and for which action (the error message's subject).
            deadline: a shared deadline of several waits (at least 1 ms is left to each).
            label: record the wait as ``on_wait(label, start, end)``.

        Raises:
            RuntimeError: on timeout or a failed transfer, naming this rank and ``what``.
        """
        if work is None:
            raise RuntimeError(f"pipeline rank {self.rank}: internal error, nothing was posted for {what}")
        budget = self.timeout if deadline is None else max(deadline - time.monotonic(), 1e-3)
        start = time.perf_counter()
        bounded_wait(work, f"{self.who()}: waiting for {what}", timeout=budget, hint=_PEER_HINT)
        if label is not None and self._on_wait is not None:
            self._on_wait(label, start, time.perf_counter())

    def collective(self, start: Callable[[], dist.Work], what: str) -> None:
        """Start an asynchronous collective of the pipeline group (``start()``) and wait for it, bounded.

        Raises:
            RuntimeError: it could not start (a rank crashed), or the wait failed or timed out.
        """
        try:
            work = start()
        except Exception as exc:
            raise RuntimeError(
                f"pipeline rank {self.rank}: could not start {what} (did a rank crash?): {exc}"
            ) from exc
        self.wait(work, what)


def completed(work: dist.Work) -> bool:
    """Non-blocking completion check; a failed transfer counts as not done (the blocking wait reports it)."""
    try:
        return bool(work.is_completed())
    except Exception:  # the error is raised again, with context, by the blocking wait
        return False
