"""The errors graph capture and replay raise (their own module so every backend imports them one way)."""

from __future__ import annotations

__all__ = ["GraphCaptureError", "GraphReplayError"]


class GraphCaptureError(RuntimeError):
    """The function cannot be captured as a graph (data-dependent control flow, host syncs, ...)."""


class GraphReplayError(RuntimeError):
    """A replay would read or write memory that no longer is what was captured."""
