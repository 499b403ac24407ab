"""Load-independent measurements of one part of an overlapped pair: its thread's CPU time and context switches.

Wall times on a shared machine say little; the CPU time a thread spent (``time.thread_time``) and how often it
was switched out (``getrusage(RUSAGE_THREAD)``) do not depend on what else runs. Used for the ``thread_stats``
of :func:`~splitgrad.parallel.expert.overlapped_forward_backward`.
"""

from __future__ import annotations

import logging
import time

import torch

__all__ = ["ThreadProbe", "thread_usage"]

logger = logging.getLogger(__name__)


def thread_usage() -> tuple[int, int] | None:
    """(voluntary, involuntary) context switches of the calling thread, where the OS reports them (Linux)."""
    try:
        import resource

        usage = resource.getrusage(resource.RUSAGE_THREAD)
    except (ImportError, AttributeError, OSError):
        return None
    return usage.ru_nvcsw, usage.ru_nivcsw


class ThreadProbe:
    """Wall span, CPU time and context switches of the calling thread between construction and :meth:`stop`,
    stored as ``stats[part]`` (nothing when ``stats`` is None)."""

    def __init__(self, stats: dict | None, part: str) -> None:
        self.stats, self.part = stats, part
        if stats is not None:
            self.usage = thread_usage()
            self.start, self.cpu = time.perf_counter(), time.thread_time()

    def stop(self) -> dict | None:
        """Store and return ``{"start", "end", "cpu", "num_threads"[, "voluntary", "involuntary"]}``."""
        if self.stats is None:
            return None
        end, cpu = time.perf_counter(), time.thread_time()
        entry = {
            "start": self.start,
            "end": end,
            "cpu": cpu - self.cpu,
            "num_threads": torch.get_num_threads(),
        }
        usage = thread_usage()
        if usage is not None and self.usage is not None:
            entry["voluntary"] = usage[0] - self.usage[0]
            entry["involuntary"] = usage[1] - self.usage[1]
        self.stats[self.part] = entry
        return entry
