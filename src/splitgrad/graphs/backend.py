"""The graph-backend interface: capture a function once, replay only its tensor work.

:func:`splitgrad.graphs.make_graphed_callables` never calls ``torch.cuda.CUDAGraph`` directly; it asks a
:class:`GraphBackend` to run warm-up iterations and to capture closures. The library ships one:
:class:`~splitgrad.graphs.cuda_backend.CudaGraphBackend` — real CUDA graphs, one memory pool shared by every
graph of one ``make_graphed_callables`` call, warm-up on a side stream. The CPU emulator that records aten
operations and replays them (:class:`splitgrad.testing.CpuGraphBackend`) is a test double: opt-in, passed as an
instance, never chosen by ``"auto"`` (replaying from Python is slower than running eagerly).
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
    "resolve_backend",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")


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
    """Turn ``backend`` (``"auto"``, ``"cuda"`` or an instance) into a backend instance.

    ``"auto"`` picks CUDA graphs when the sample tensors live on a CUDA device. On any other device there is no
    graph backend that beats eager execution, so ``"auto"`` raises rather than hand back something slower:
    call the layers eagerly there, or pass a backend instance (tests: ``splitgrad.testing.CpuGraphBackend()``).

    Raises:
        ValueError: unknown name, ``"auto"``/``"cuda"`` with non-CUDA tensors, or sample tensors spread over
            several devices.
    """
    if not isinstance(backend, str):
        if not isinstance(backend, GraphBackend):
            raise ValueError(f"backend must be 'auto', 'cuda' or a GraphBackend instance, got {backend!r}")
        return backend
    if backend not in ("auto", "cuda"):
        hint = (
            " (the CPU emulator is splitgrad.testing.CpuGraphBackend(), a test double)"
            if backend == "cpu"
            else ""
        )
        raise ValueError(
            f"unknown graph backend {backend!r}; expected 'auto', 'cuda' or a GraphBackend{hint}"
        )
    devices = {t.device for t in _tensors(sample_args)}
    if len(devices) > 1:
        raise ValueError(f"sample tensors must all live on one device, got {sorted(map(str, devices))}")
    device = devices.pop() if devices else torch.device("cpu")
    if device.type != "cuda":
        raise ValueError(
            f"backend={backend!r} needs CUDA sample tensors, got tensors on {device}: no graph backend runs "
            "faster than eager there, so call the layers eagerly (for tests of the capture logic, pass "
            "backend=splitgrad.testing.CpuGraphBackend())"
        )
    from .cuda_backend import CudaGraphBackend

    return CudaGraphBackend(device)
