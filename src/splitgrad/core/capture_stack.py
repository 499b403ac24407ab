"""The process-wide stack of open :func:`~splitgrad.capture_wgrad` bundles.

Its own module so that the store (which asks "is a capture open?" when it parks a task) and the bundles (which
build on tasks, which build on the store) import it without an import cycle.
"""

from __future__ import annotations

import threading
from typing import Any

__all__ = ["CAPTURES"]


class _CaptureStack:
    """Process-wide stack of open capture bundles.

    Process-wide on purpose (an exception to "no module-level state"): CUDA backward runs on autograd's own
    device threads, which inherit neither thread-locals nor contextvars from the thread that called
    ``loss.backward()``, so a per-thread stack would silently miss tasks deferred there. For the same reason a
    second thread may not open a capture while one is open: its tasks would land in the other's bundle.
    """

    def __init__(self) -> None:
        self._stack: list[Any] = []
        self._thread: int | None = None
        self._lock = threading.Lock()

    def push(self, bundle: Any) -> None:
        me = threading.get_ident()
        with self._lock:
            if self._stack and self._thread != me:
                raise RuntimeError(
                    f"capture_wgrad opened in thread {me} while thread {self._thread} has one open; captures are "
                    "process-wide (autograd's device threads must see them), so two threads cannot capture at "
                    "once: serialise the backward passes you capture"
                )
            self._thread = me
            self._stack.append(bundle)

    def pop(self, bundle: Any) -> None:
        with self._lock:
            on_top = bool(self._stack) and self._stack[-1] is bundle
            # Remove it either way, so one misuse cannot leave a stale bundle swallowing all later work.
            self._stack[:] = [b for b in self._stack if b is not bundle]
            if not self._stack:
                self._thread = None
        if not on_top:
            raise RuntimeError("capture_wgrad blocks must be exited in the reverse order they were entered")

    def top(self) -> Any | None:
        with self._lock:
            return self._stack[-1] if self._stack else None


CAPTURES = _CaptureStack()
"""The one stack (see :class:`_CaptureStack` for why it is process-wide)."""
