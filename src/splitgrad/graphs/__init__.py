"""CUDA-graph capture with a separate wgrad graph (``splitgrad.graphs.make_graphed_callables``).

A layer's forward, its backward (input gradients and the non-deferred weight gradients) and its deferred weight
gradient become three graphs; ``GraphedCallable.backward_dw()`` replays the third and then fires the wgrad hooks
that no graph can contain. Backends: real CUDA graphs, and a CPU stand-in that records and replays aten ops so
the same failure modes are caught in CI. See ``docs/graphs.md``.
"""

from __future__ import annotations

from .api import make_graphed_callables
from .backend import Graph, GraphBackend, GraphCaptureError, GraphReplayError, resolve_backend
from .cpu_backend import CpuGraph, CpuGraphBackend
from .cuda_backend import CudaGraph, CudaGraphBackend
from .graphed import GraphedCallable
from .order import GraphAction

__all__ = [
    "CpuGraph",
    "CpuGraphBackend",
    "CudaGraph",
    "CudaGraphBackend",
    "Graph",
    "GraphAction",
    "GraphBackend",
    "GraphCaptureError",
    "GraphReplayError",
    "GraphedCallable",
    "make_graphed_callables",
    "resolve_backend",
]
