"""Whether a torch profiler is recording: hot paths open their named ranges only then."""

from __future__ import annotations

import torch

__all__ = ["profiler_active"]


def profiler_active() -> bool:
    """Whether a torch profiler is recording on this thread's process (autograd profiler or Kineto).

    A ``record_function`` range costs about 8 us of CPU on a warm cache and several times that right after a
    long GEMM, and nothing sees it without a profiler, so splitgrad's per-action and per-task ranges are opened
    only then. ``torch.autograd._profiler_enabled`` is the check torch's own modules use; without it (another
    torch version) ranges are always opened.
    """
    enabled = getattr(torch.autograd, "_profiler_enabled", None)
    return True if enabled is None else bool(enabled())
