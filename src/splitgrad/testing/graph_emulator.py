"""A CPU stand-in for CUDA graphs: record the aten operations once, replay only them, into the same tensors.

CI machines have no GPU, yet the capture logic of :func:`~splitgrad.graphs.make_graphed_callables` has the
bugs CUDA graphs punish: a hook that ran during capture but not on replay, a ``.grad`` rebound to a fresh
tensor that the graph no longer writes, a buffer re-allocated between replays. This backend behaves like a
graph so that the same bugs fail on CPU:

* **capture** runs the function once for real under a :class:`~torch.utils._python_dispatch.TorchDispatchMode`
  that records every aten call (below autograd, so backward kernels are recorded too) together with the
  tensor *objects* it read and wrote;
* **replay** re-executes only those aten calls on the recorded tensors: functional results are copied into
  the tensors recorded at capture (never re-bound), in-place and ``out=`` calls write their operands again,
  view calls are not re-run (the recorded views still alias their bases). No Python code of the function
  runs: hooks, prints, counters and attribute writes happen at capture only.

Strict checks, mirroring what would silently corrupt memory on a GPU:

* capture refuses operations whose output is data-dependent (``.item()``, ``bool(tensor)``, ``nonzero``):
  they need a device-to-host sync that CUDA graph capture forbids;
* tensors the graph did not allocate (parameters, static inputs, gradient buffers) are held by weak reference
  to their storage, like a CUDA graph holding raw addresses: replay raises :class:`GraphReplayError` if that
  memory was freed, or if a tensor was re-allocated or re-shaped (``param.data = ...``, ``resize_``);
* a replayed result whose shape or dtype differs from the captured one raises instead of re-allocating;
* the graphs of one backend share a pool, as on a GPU, in the worst case: replaying a graph overwrites the
  memory allocated by every graph captured after it with NaN, so replaying out of capture order (a wgrad graph
  after a later-captured backward graph whose results are still needed, say) corrupts gradients visibly.

Replay timing is Python-bound (one Python call per aten op): it says nothing about CUDA-graph speed.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..graphs.errors import GraphCaptureError, GraphReplayError

try:  # storage-level weak references: "the memory was freed", not "this Python wrapper died"
    from torch.multiprocessing.reductions import StorageWeakRef

    torch.UntypedStorage._new_with_weak_ptr  # noqa: B018
except (ImportError, AttributeError):  # pragma: no cover - older/newer torch: hold externals strongly
    StorageWeakRef = None  # type: ignore[assignment,misc]

__all__ = ["CpuGraph", "CpuGraphBackend"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Factories whose output content is undefined: re-running them on replay would only cost an allocation.
_UNDEFINED_CONTENT = frozenset({"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided"})
# Python-data constants enter the graph through these; the graph owns them (a CUDA kernel bakes scalars in).
_CONSTANT_SOURCES = frozenset({"lift_fresh", "lift_fresh_copy"})
_UNCAPTURABLE_TAGS = (torch.Tag.data_dependent_output, torch.Tag.dynamic_output_shape)


class _Ref:
    """Placeholder for the tensor in slot ``slot`` inside a recorded argument structure."""

    __slots__ = ("slot",)

    def __init__(self, slot: int) -> None:
        self.slot = slot


class _Seq:
    """A list/tuple argument that contains tensors (``cat``, ``index``, ``_foreach_*``)."""

    __slots__ = ("items", "kind")

    def __init__(self, kind: type, items: list[Any]) -> None:
        self.kind = kind
        self.items = items


def _decode(value: Any, live: list[torch.Tensor]) -> Any:
    if isinstance(value, _Ref):
        return live[value.slot]
    if isinstance(value, _Seq):
        return value.kind(_decode(v, live) for v in value.items)
    return value


def _flat_outputs(result: Any) -> Iterator[Any]:
    if isinstance(result, (tuple, list)):
        for item in result:
            yield from _flat_outputs(item)
    else:
        yield result


def _meta(t: torch.Tensor) -> tuple:
    return (t.data_ptr(), t.dtype, tuple(t.shape), t.stride())


class _Op:
    __slots__ = ("args", "func", "kwargs", "outs")

    def __init__(self, func: Any, args: tuple, kwargs: dict, outs: list[int | None]) -> None:
        self.func = func
        self.args = args
        self.kwargs = kwargs
        self.outs = outs  # one slot per flat output; None for non-tensor outputs


class _Recorder(TorchDispatchMode):
    """Runs every aten call for real and records it with slot references to the tensors involved."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # The default wraps __torch_dispatch__ in torch._disable_dynamo, whose first call imports all of
        # torch._dynamo (seconds); nothing here is ever compiled.
        return False

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[_Op] = []
        self.tensors: list[torch.Tensor] = []  # strong during capture: ids stay unique
        self.internal: list[bool] = []  # allocated by a recorded op (owned by the graph)
        self.constant: list[bool] = []
        self._slot_of: dict[int, int] = {}

    def _slot(self, t: torch.Tensor, *, internal: bool) -> int:
        slot = self._slot_of.get(id(t))
        if slot is not None and self.tensors[slot] is t:
            return slot
        slot = len(self.tensors)
        self.tensors.append(t)
        self.internal.append(internal)
        self.constant.append(False)
        self._slot_of[id(t)] = slot
        return slot

    def _encode(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return _Ref(self._slot(value, internal=False))
        if isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value):
            return _Seq(type(value), [self._encode(v) for v in value])
        return value

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        if func.namespace == "profiler":
            return func(*args, **kwargs)
        if any(tag in func.tags for tag in _UNCAPTURABLE_TAGS):
            raise GraphCaptureError(
                f"{func} cannot be captured in a graph: its result depends on tensor data (a device-to-host "
                "sync, e.g. .item(), bool(tensor), nonzero, masked_select); CUDA graph capture forbids it. "
                "Move data-dependent logic out of the captured callable."
            )
        enc_args = tuple(self._encode(a) for a in args)
        enc_kwargs = {k: self._encode(v) for k, v in kwargs.items()}
        name = func.overloadpacket.__name__
        if name in _CONSTANT_SOURCES:
            for ref in enc_args:
                if isinstance(ref, _Ref):
                    self.constant[ref.slot] = True
        result = func(*args, **kwargs)
        outs = [
            self._slot(out, internal=True) if isinstance(out, torch.Tensor) else None
            for out in _flat_outputs(result)
        ]
        if not func.is_view and name not in _UNDEFINED_CONTENT:
            self.ops.append(_Op(func, enc_args, enc_kwargs, outs))
        return result


class _External:
    """A tensor the graph did not allocate: referenced weakly, like the raw address a CUDA graph keeps.

    The Python object may die while its memory lives on (autograd unpacks saved outputs into fresh wrapper
    objects, for instance); replay then rebuilds a tensor over the same storage. Only when the storage itself
    was freed is the replay refused.
    """

    __slots__ = ("meta", "obj", "offset", "storage")

    def __init__(self, t: torch.Tensor) -> None:
        self.obj = weakref.ref(t)
        self.meta = _meta(t)
        self.offset = t.storage_offset()
        self.storage = StorageWeakRef(t.untyped_storage()) if StorageWeakRef is not None else t

    def get(self) -> torch.Tensor | None:
        t = self.obj()
        if t is not None:
            return t
        if StorageWeakRef is None:
            return self.storage  # type: ignore[return-value]  # no storage weak refs: held strongly
        if self.storage.expired():
            return None
        storage = torch.UntypedStorage._new_with_weak_ptr(self.storage.cdata)
        _, dtype, shape, stride = self.meta
        return torch.empty(0, dtype=dtype, device=storage.device).set_(storage, self.offset, shape, stride)


class CpuGraph:
    """The recorded aten calls of one capture; :meth:`replay` re-runs them on the same tensors.

    Tensors allocated by the recorded ops are owned by the graph (like a CUDA graph's private pool);
    the others are weakly referenced and checked before every replay.
    """

    def __init__(self, recorder: _Recorder, *, label: str = "", pool: _Pool | None = None) -> None:
        self.label = label
        self._ops = recorder.ops
        self._slots: list[torch.Tensor | _External] = []
        self._meta: list[tuple] = []
        for t, internal, constant in zip(recorder.tensors, recorder.internal, recorder.constant):
            self._slots.append(t if internal or constant else _External(t))
            self._meta.append(_meta(t))
        # Pool memory: tensors this graph allocated, minus views of memory it does not own and constants.
        foreign = {
            t.untyped_storage().data_ptr()
            for t, internal, constant in zip(recorder.tensors, recorder.internal, recorder.constant)
            if constant or not internal
        }
        self._pool_tensors = [
            t
            for t, internal, constant in zip(recorder.tensors, recorder.internal, recorder.constant)
            if internal and not constant and t.untyped_storage().data_ptr() not in foreign
        ]
        self._pool = pool
        self._pool_index = pool.register(self) if pool is not None else -1
        self.replays = 0

    def _scribble(self) -> None:
        """Overwrite this graph's pool memory with garbage (NaN, or the largest integer)."""
        with torch.no_grad():
            for t in self._pool_tensors:
                if t.is_floating_point() or t.is_complex():
                    t.fill_(float("nan"))
                elif t.dtype != torch.bool:
                    t.fill_(torch.iinfo(t.dtype).max)

    def _live(self) -> list[torch.Tensor]:
        live: list[torch.Tensor] = []
        for slot, (entry, meta) in enumerate(zip(self._slots, self._meta)):
            t = entry.get() if isinstance(entry, _External) else entry
            if t is None:
                raise GraphReplayError(
                    f"graph {self.label!r}: tensor {slot} (shape {meta[2]}, {meta[1]}) it reads or writes was "
                    "freed after capture; on a GPU the replay would touch freed memory. Keep every tensor the "
                    "graph uses (parameters, static inputs, gradient buffers) alive, or re-capture."
                )
            now = _meta(t)
            if now != meta:
                raise GraphReplayError(
                    f"graph {self.label!r}: tensor {slot} was re-allocated or re-shaped after capture "
                    f"(shape {meta[2]} -> {now[2]}, stride {meta[3]} -> {now[3]}, "
                    f"{'same' if now[0] == meta[0] else 'different'} memory); the graph still uses the captured "
                    "memory. Update tensors in place (copy_), never rebind .data or resize them."
                )
            live.append(t)
        return live

    @property
    def num_ops(self) -> int:
        """How many aten calls a replay executes."""
        return len(self._ops)

    def replay(self) -> None:
        """Re-execute the recorded aten calls; results land in the tensors recorded at capture."""
        live = self._live()
        if self._pool is not None:
            self._pool.before_replay(self._pool_index)
        with torch.no_grad():
            for op in self._ops:
                args = [_decode(a, live) for a in op.args]
                kwargs = {k: _decode(v, live) for k, v in op.kwargs.items()}
                result = op.func(*args, **kwargs)
                for slot, fresh in zip(op.outs, _flat_outputs(result)):
                    if slot is None or not isinstance(fresh, torch.Tensor):
                        continue
                    target = live[slot]
                    if fresh is target:
                        continue
                    if fresh.shape != target.shape or fresh.dtype != target.dtype:
                        raise GraphReplayError(
                            f"graph {self.label!r}: replaying {op.func} produced {tuple(fresh.shape)} "
                            f"{fresh.dtype}, captured {tuple(target.shape)} {target.dtype}; a graph cannot "
                            "re-allocate its buffers"
                        )
                    if fresh.data_ptr() != target.data_ptr() or fresh.stride() != target.stride():
                        target.copy_(fresh)
        self.replays += 1

    def __repr__(self) -> str:
        return f"CpuGraph({self.label!r}, ops={len(self._ops)}, tensors={len(self._meta)})"


class _Pool:
    """Emulates the memory pool the CUDA backend shares between the graphs of one capture session.

    On a GPU, a graph captured later may be handed memory that an earlier graph used as scratch, so replaying
    the earlier graph again overwrites whatever the later one left there. That is harmless when graphs replay
    in capture order (the later graph's results are consumed before the earlier graph comes round again) and
    corrupts gradients otherwise. The emulation assumes the worst: replaying graph ``i`` scribbles garbage over
    the pool memory of every graph captured after it, so a wrong replay order shows up as NaN gradients.
    """

    def __init__(self) -> None:
        self._graphs: list[weakref.ref[CpuGraph]] = []

    def register(self, graph: CpuGraph) -> int:
        self._graphs.append(weakref.ref(graph))
        return len(self._graphs) - 1

    def before_replay(self, index: int) -> None:
        for ref in self._graphs[index + 1 :]:
            later = ref()
            if later is not None:
                later._scribble()


class CpuGraphBackend:
    """The CPU stand-in backend (see the module docstring); works on tensors of any device.

    Args:
        label_prefix: prefix of the graphs' labels in error messages.
        shared_pool: emulate the shared memory pool of the CUDA backend (see :class:`_Pool`): replaying a
            graph overwrites the pool memory of the graphs captured after it. Off only for timing.
    """

    name = "cpu"

    def __init__(self, *, label_prefix: str = "", shared_pool: bool = True) -> None:
        self.label_prefix = label_prefix
        self._pool = _Pool() if shared_pool else None

    def warmup(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def capture(self, fn: Callable[[], T], *, label: str = "") -> tuple[CpuGraph, T]:
        recorder = _Recorder()
        with recorder:
            result = fn()
        graph = CpuGraph(recorder, label=f"{self.label_prefix}{label}", pool=self._pool)
        logger.debug("captured %r", graph)
        return graph, result

    def synchronize(self) -> None:
        pass
