"""The real backend: ``torch.cuda.CUDAGraph`` with one memory pool per ``make_graphed_callables`` call.

Untested on the machine this was written on (no GPU); ``tests/graphs/test_cuda_graphs.py`` and
``benchmarks/bench_graphs.py`` exercise it where CUDA is present.

Why it looks like this (the same reasons as ``torch.cuda.make_graphed_callables``):

* warm-up runs on a side stream so that lazy initialisation (cuBLAS handles, autotuning) and the caching
  allocator's first allocations happen outside any capture;
* every graph of one call shares a private memory pool, so the forward, backward and wgrad graphs of many
  layers/microbatches cost the memory of their live tensors, not the sum of their peaks. Sharing is safe only
  if the graphs replay in the order they were captured: the order :func:`make_graphed_callables` is given.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch

from .errors import GraphCaptureError

__all__ = ["CudaGraph", "CudaGraphBackend"]

logger = logging.getLogger(__name__)

T = TypeVar("T")


class CudaGraph:
    """A captured ``torch.cuda.CUDAGraph``; :meth:`replay` launches it on the current stream."""

    def __init__(self, graph: torch.cuda.CUDAGraph, *, label: str = "") -> None:
        self.graph = graph
        self.label = label
        self.replays = 0

    def replay(self) -> None:
        self.graph.replay()
        self.replays += 1

    def __repr__(self) -> str:
        return f"CudaGraph({self.label!r})"


class CudaGraphBackend:
    """CUDA graphs on ``device``.

    Args:
        device: the CUDA device of the sample tensors.
        pool: a memory-pool token (``torch.cuda.graph_pool_handle()``) to share with graphs captured
            elsewhere; default: a fresh pool shared by this backend's graphs only.
    """

    name = "cuda"

    def __init__(self, device: torch.device | str | int | None = None, *, pool: Any = None) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("CudaGraphBackend needs CUDA, but torch.cuda.is_available() is False")
        self.device = (
            torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
        )
        if self.device.type != "cuda":
            raise ValueError(f"CudaGraphBackend needs a CUDA device, got {self.device}")
        with torch.cuda.device(self.device):
            self.pool = torch.cuda.graph_pool_handle() if pool is None else pool

    @contextlib.contextmanager
    def warmup(self) -> Iterator[None]:
        with torch.cuda.device(self.device):
            torch.cuda.synchronize()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                yield
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()

    def capture(self, fn: Callable[[], T], *, label: str = "") -> tuple[CudaGraph, T]:
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.device(self.device), torch.cuda.graph(graph, pool=self.pool):
                result = fn()
        except RuntimeError as err:
            if isinstance(err, GraphCaptureError):
                raise
            raise GraphCaptureError(f"CUDA graph capture of {label!r} failed: {err}") from err
        logger.debug("captured CUDA graph %s", label)
        return CudaGraph(graph, label=label), result

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)
