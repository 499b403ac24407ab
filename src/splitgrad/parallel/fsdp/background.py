"""A background reducer: FSDP2 reduce-scatters run on one worker thread, in submission order.

Why a thread: FSDP2 calls its reduce-scatter synchronously (``foreach_reduce`` reads the output right after the
collective, so a custom ``ReduceScatter`` cannot return early), and on CPU (gloo) nothing else can run in the
meantime. A worker thread that calls the group's own ``post_backward`` lets the caller go on with the
remaining weight-gradient work; the collective itself releases the GIL inside gloo. One worker keeps the
collectives in the same order on every rank (every data-parallel replica submits the same groups in the same
order), and the groups' reduce-scatter runs on a process group of its own
(``set_separate_reduce_scatter_group``), so an all-gather on the main thread never interleaves with it.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import time
from collections.abc import Callable

__all__ = ["BackgroundReducer"]

logger = logging.getLogger(__name__)


class BackgroundReducer:
    """Runs submitted reductions on one worker thread; :meth:`wait` joins them and re-raises a failure.

    Args:
        name: for messages and the thread name.
        timeout: seconds :meth:`wait` allows each pending reduction before raising.
        max_events: how many of the latest ``(label, start, end)`` records :attr:`events` keeps.
    """

    def __init__(self, name: str, *, timeout: float, max_events: int = 1024) -> None:
        if not timeout > 0:
            raise ValueError(f"{name}: timeout must be positive seconds, got {timeout=}")
        self.name = name
        self.timeout = float(timeout)
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="splitgrad-fsdp-rs"
        )
        self._pending: list[tuple[str, concurrent.futures.Future]] = []
        self.events: collections.deque[tuple[str, float, float]] = collections.deque(maxlen=max_events)

    @property
    def pending(self) -> int:
        """Reductions submitted and not yet joined by :meth:`wait`."""
        return len(self._pending)

    def submit(self, label: str, reduce: Callable[[], None]) -> None:
        """Queue ``reduce`` behind every earlier submission; its ``[start, end)`` is recorded as ``label``."""

        def timed() -> tuple[float, float]:
            start = time.perf_counter()
            reduce()
            return start, time.perf_counter()

        self._pending.append((label, self._pool.submit(timed)))

    def wait(self) -> None:
        """Join every pending reduction, in order.

        Raises:
            RuntimeError: a reduction failed (its error chained) or did not finish within ``timeout``.
        """
        pending, self._pending = self._pending, []
        for i, (label, future) in enumerate(pending):
            try:
                start, end = future.result(timeout=self.timeout)
            except concurrent.futures.TimeoutError as exc:
                self._pending = pending[i:]
                raise RuntimeError(
                    f"{self.name}: background {label} did not finish within {self.timeout} s "
                    "(did another data-parallel rank stop submitting, or crash?)"
                ) from exc
            except Exception as exc:
                self._pending = pending[i + 1 :]  # the later ones still run: the next wait() joins them
                raise RuntimeError(f"{self.name}: background {label} failed: {exc}") from exc
            self.events.append((label, start, end))

    def close(self) -> None:
        """Join what is pending (errors re-raised) and stop the worker thread."""
        try:
            self.wait()
        finally:
            self._pool.shutdown(wait=True)
