"""CUDA-graph capture with a separate wgrad graph (``splitgrad.graphs.make_graphed_callables``).

A layer's forward, its backward (input gradients and the non-deferred weight gradients) and its deferred weight
gradient become three graphs; ``GraphedCallable.backward_dw()`` replays the third and then fires the wgrad hooks
that no graph can contain. Backend: real CUDA graphs; the CPU emulator that records and replays aten ops (so CI catches the same
failure modes) is a test double in :mod:`splitgrad.testing`. See ``docs/graphs.md``.

``GraphBackend`` is public because ``make_graphed_callables(..., backend=...)`` takes one; a backend's
``capture`` returns a :class:`splitgrad.graphs.backend.Graph`. The CUDA graph wrapper, the backend resolver and
the capture-order actions are internals, imported from their submodules.
"""

from __future__ import annotations

from .api import make_graphed_callables
from .backend import GraphBackend
from .cuda_backend import CudaGraphBackend
from .errors import GraphCaptureError, GraphReplayError
from .graphed import GraphedCallable

__all__ = [
    "CudaGraphBackend",
    "GraphBackend",
    "GraphCaptureError",
    "GraphReplayError",
    "GraphedCallable",
    "make_graphed_callables",
]
