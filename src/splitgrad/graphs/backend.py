"""The graph-backend interface: capture a function once, replay only its tensor work.

:func:`splitgrad.graphs.make_graphed_callables` never calls ``torch.cuda.CUDAGraph`` directly; it asks a
:class:`GraphBackend` to run warm-up iterations and to capture closures. Two backends implement it:

* :class:`~splitgrad.graphs.cuda_backend.CudaGraphBackend` — real CUDA graphs, one memory pool shared by every
  graph of one ``make_graphed_callables`` call, warm-up on a side stream;
* :class:`~splitgrad.graphs.cpu_backend.CpuGraphBackend` — a CPU stand-in that records the aten operations of
  the captured function and replays only those into the same tensors, so CI without a GPU exercises the same
  failure modes (Python side effects that do not replay, buffers that move between replays).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager
from typing import Protocol, TypeVar, runtime_checkable

import torch

__all__ = [
    "Graph",
    "GraphBackend",
    "GraphCaptureError",
    "GraphReplayError",
    "resolve_backend",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")


class GraphCaptureError(RuntimeError):
    """The function cannot be captured as a graph (data-dependent control flow, host syncs, ...)."""


class GraphReplayError(RuntimeError):
    """A replay would read or write memory that no longer is what was captured."""


@runtime_checkable
class Graph(Protocol):
    """A captured sequence of device work; ``replay()`` re-runs it on the captured memory, no Python."""

    def replay(self) -> None: ...


@runtime_checkable
class GraphBackend(Protocol):
    """How graphs are warmed up, captured and synchronised on one kind of device.

    One backend instance serves one :func:`~splitgrad.graphs.make_graphed_callables` call: the graphs it
    captures may share memory (CUDA: one private pool), so they must replay in a compatible order.
    """

    name: str
    """Short name shown in logs and benchmark tables (``"cuda"``, ``"cpu"``)."""

    def warmup(self) -> AbstractContextManager[None]:
        """Context for the eager warm-up iterations (CUDA: a side stream, so lazy init stays out of graphs)."""
        ...

    def capture(self, fn: Callable[[], T], *, label: str = "") -> tuple[Graph, T]:
        """Run/record ``fn`` once as a graph; returns the graph and ``fn``'s return value.

        ``label`` names the graph in errors and logs (e.g. ``"Linear[0] mb0 backward"``).

        The returned tensors live in the graph's memory: every replay rewrites them in place.
        """
        ...

    def synchronize(self) -> None:
        """Wait for all replayed work (for timing)."""
        ...


def _tensors(nested: Iterable[object]) -> Iterator[torch.Tensor]:
    for item in nested:
        if isinstance(item, torch.Tensor):
            yield item
        elif isinstance(item, (tuple, list)):
            yield from _tensors(item)


def resolve_backend(backend: str | GraphBackend, sample_args: Iterable[object]) -> GraphBackend:
    """Turn ``backend`` (``"auto"``, ``"cuda"``, ``"cpu"`` or an instance) into a backend instance.

    ``"auto"`` picks CUDA graphs when the sample tensors live on a CUDA device and the CPU stand-in when
    they live on the CPU. ``"cpu"`` (the stand-in) also works on CUDA tensors, as a debugging aid.

    Raises:
        ValueError: unknown name, or sample tensors spread over several devices.
    """
    if not isinstance(backend, str):
        if not isinstance(backend, GraphBackend):
            raise ValueError(f"backend must be 'auto', 'cuda', 'cpu' or a GraphBackend, got {backend!r}")
        return backend
    devices = {t.device for t in _tensors(sample_args)}
    if len(devices) > 1:
        raise ValueError(f"sample tensors must all live on one device, got {sorted(map(str, devices))}")
    device = devices.pop() if devices else torch.device("cpu")
    name = backend
    if name == "auto":
        name = "cuda" if device.type == "cuda" else "cpu"
    if name == "cuda":
        if device.type != "cuda":
            raise ValueError(f"backend='cuda' needs CUDA sample tensors, got tensors on {device}")
        from .cuda_backend import CudaGraphBackend

        return CudaGraphBackend(device)
    if name == "cpu":
        from .cpu_backend import CpuGraphBackend

        return CpuGraphBackend()
    raise ValueError(f"unknown graph backend {backend!r}; expected 'auto', 'cuda', 'cpu' or a GraphBackend")
