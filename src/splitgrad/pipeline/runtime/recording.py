"""What a running pipeline records: per-action timestamps, activation bytes, and the ranks' events gathered.

Each rank records the start and end of every action it runs (and of every receive it waits for) with
``time.perf_counter`` relative to a step origin ``t0`` taken right after a barrier of the pipeline group, so
all ranks share the origin up to the barrier's exit skew (tens of microseconds on one host). Events are
:class:`~splitgrad.pipeline.timeline.TimelineEvent`\\ s in seconds, so the renderers and the torch-free
analysis (:mod:`splitgrad.pipeline.timeline`) read measured and simulated runs alike; this module is the
torch half: the recorder, the activation meter and the gather over the pipeline group.
"""

from __future__ import annotations

import contextlib
import pickle
import time
from collections.abc import Iterable, Iterator, Sequence

import torch
import torch.distributed as dist

from ..ir.actions import Action
from ..timeline.events import TimelineEvent

__all__ = ["ActivationMeter", "TimelineRecorder", "gather_events"]


class TimelineRecorder:
    """Collects one rank's :class:`TimelineEvent`\\ s (seconds since the step's ``t0``).

    :meth:`action` also opens a ``torch.profiler.record_function`` range named like the action (``"1F0"``), so
    a profiler trace shows the same names, whether or not timeline recording is enabled (the runtime times
    its actions itself and opens the range only while a profiler records, see
    :func:`splitgrad.core.profiling.profiler_active`).

    Args:
        rank: the pipeline rank the events are attributed to.
        enabled: record events (the profiler ranges are opened either way).
    """

    def __init__(self, rank: int, *, enabled: bool = True) -> None:
        self.rank = rank
        self.enabled = enabled
        self.t0 = time.perf_counter()
        self.events: list[TimelineEvent] = []

    def start(self, t0: float | None = None) -> None:
        """Begin a step: drop old events; ``t0`` defaults to now."""
        self.t0 = time.perf_counter() if t0 is None else t0
        self.events = []

    @contextlib.contextmanager
    def action(self, action: Action) -> Iterator[None]:
        """Time the block as ``action``'s compute event."""
        with torch.profiler.record_function(action.name):
            start = time.perf_counter()
            yield
            end = time.perf_counter()
        self.record(action, start, end)

    def record(self, action: Action, start: float, end: float) -> None:
        """Record ``action``'s compute event over ``[start, end)`` (``perf_counter`` values) when enabled; the
        runtime times its actions itself and calls this, which costs less than the :meth:`action` block."""
        if self.enabled:
            self.events.append(TimelineEvent.from_action(self.rank, action, start - self.t0, end - self.t0))

    def comm(
        self, label: str, start: float, end: float, *, stage: int | None = None, kind: str = "comm"
    ) -> None:
        """Record a communication ``[start, end)`` (``perf_counter`` values) on the side track: a receive wait
        (kind ``"comm"``), or a stage's data-parallel reduction (kind ``"grad-sync"``, kept out of the
        receive-wait statistics)."""
        if self.enabled:
            self.events.append(TimelineEvent(self.rank, label, start - self.t0, end - self.t0, kind, stage))


def gather_events(
    events: Sequence[TimelineEvent], *, group: dist.ProcessGroup | None = None, dst: int = 0
) -> list[TimelineEvent] | None:
    """Collect every rank's events on group rank ``dst`` (a collective: every rank of ``group`` calls it).

    Returns:
        All events sorted by start time on ``dst``; None on the other ranks.
    """
    gathered = _gather_pickled([tuple(e) for e in events], group=group, dst=dst)
    if gathered is None:
        return None
    merged = [TimelineEvent(*e) for part in gathered for e in part]
    return sorted(merged, key=lambda e: (e.start, e.rank))


def _gather_pickled(obj: object, *, group: dist.ProcessGroup | None, dst: int) -> list | None:
    """``dist.gather_object`` without numpy: torch's version calls ``Tensor.numpy()``, which raises
    "Numpy is not available" in an environment with only torch installed.

    Returns:
        One unpickled object per group rank on group rank ``dst``; None elsewhere.
    """
    rank = dist.get_rank(group)
    size = dist.get_world_size(group)
    dst_global = dst if group is None else dist.get_global_rank(group, dst)
    # NCCL moves CUDA tensors only; every other backend here takes CPU tensors.
    on_nccl = dist.get_backend(group) == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if on_nccl else torch.device("cpu")
    payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(device)
    lengths = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(size)]
    dist.all_gather(lengths, torch.tensor([payload.numel()], dtype=torch.int64, device=device), group=group)
    longest = max(int(n.item()) for n in lengths)
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[: payload.numel()] = payload
    buffers = [torch.empty_like(padded) for _ in range(size)] if rank == dst else None
    dist.gather(padded, buffers, dst=dst_global, group=group)
    if buffers is None:
        return None
    return [
        pickle.loads(bytes(buf[: int(n.item())].cpu().tolist()))
        for buf, n in zip(buffers, lengths, strict=True)
    ]


class ActivationMeter:
    """Bytes of activations autograd saves in forwards, held until that microbatch's last backward action.

    ``F(s, i)`` adds the storage bytes autograd saved during the forward (each storage once; parameters
    excluded). ``B(s, i)`` frees the graph: what stays until ``W(s, i)`` is exactly the wgrad operands parked in
    the microbatch's bundle (:meth:`splitgrad.WgradBundle.saved_bytes`), so :meth:`hold` replaces the forward's
    count by that; ``W`` (or ``BW``) releases the rest.

    Use :meth:`forward` around a forward, :meth:`hold` after a ``B``, :meth:`release` after ``W``/``BW``.
    """

    def __init__(self) -> None:
        self.live: dict[tuple[int, int], int] = {}
        self.current = 0
        self.peak = 0
        #: Per stage, every forward's saved bytes (``M_B``) and every ``B``'s kept bundle bytes (``M_W``), across
        #: steps until :meth:`clear_samples` (what a profile-guided plan reads).
        self.forward_bytes: dict[int, list[int]] = {}
        self.held_bytes: dict[int, list[int]] = {}

    def clear_samples(self) -> None:
        self.forward_bytes.clear()
        self.held_bytes.clear()

    def reset(self) -> None:
        self.live.clear()
        self.current = self.peak = 0

    @contextlib.contextmanager
    def forward(self, stage: int, microbatch: int, exclude: Iterable[torch.Tensor] = ()) -> Iterator[None]:
        """Count storages saved for backward inside the block (``exclude``: e.g. the parameters)."""
        seen = {t.untyped_storage().data_ptr() for t in exclude}
        total = 0

        def pack(t: torch.Tensor) -> torch.Tensor:
            nonlocal total
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr not in seen and storage.nbytes():
                seen.add(ptr)
                total += storage.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, _unpack):
            yield
        self.live[(stage, microbatch)] = total
        self.forward_bytes.setdefault(stage, []).append(total)
        self.current += total
        self.peak = max(self.peak, self.current)

    def hold(self, stage: int, microbatch: int, nbytes: int) -> None:
        """After ``B``: the microbatch now keeps only ``nbytes`` (its bundle's operands) until ``W``."""
        self.current += nbytes - self.live.get((stage, microbatch), 0)
        self.live[(stage, microbatch)] = nbytes
        self.held_bytes.setdefault(stage, []).append(nbytes)

    def release(self, stage: int, microbatch: int) -> None:
        self.current -= self.live.pop((stage, microbatch), 0)


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t
