"""Measured timelines of a pipeline runtime: recording, gathering, bubble ratio, and comparison with simulation.

Each rank records the start and end of every action it runs (and of every receive it waits for) with
``time.perf_counter`` relative to a step origin ``t0`` taken right after a barrier of the pipeline group, so
all ranks share the origin up to the barrier's exit skew (tens of microseconds on one host). Events are
:class:`~splitgrad.pipeline.timeline.TimelineEvent`\\ s in seconds, so the schedules' renderers draw measured and
simulated runs alike. The measured bubble ratio uses the simulator's definition (the rank with the longest
span; ``(span - compute) / span``).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import pickle
import statistics
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from ..core.profiling import profiler_active  # re-exported: its public home before core needed it
from .actions import Action, Schedule
from .replay import covered_length, replay_measured
from .simulate import SimulationResult, simulate
from .timeline import TimelineEvent, save_png, write_chrome_trace

__all__ = [
    "ActivationMeter",
    "TimelineRecorder",
    "bubble_report",
    "gather_events",
    "idle_breakdown",
    "measured_bubble_ratio",
    "measured_costs",
    "profiler_active",
    "save_measured_timeline",
    "simulate_measured",
]

logger = logging.getLogger(__name__)


class TimelineRecorder:
    """Collects one rank's :class:`TimelineEvent`\\ s (seconds since the step's ``t0``).

    :meth:`action` also opens a ``torch.profiler.record_function`` range named like the action (``"1F0"``), so
    a profiler trace shows the same names, whether or not timeline recording is enabled (the runtime times
    its actions itself and opens the range only while a profiler records, see :func:`profiler_active`).

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


def _spans(events: Iterable[TimelineEvent]) -> dict[int, tuple[float, float, float]]:
    """Per rank: ``(first compute start, last compute end, compute time)``."""
    out: dict[int, tuple[float, float, float]] = {}
    for e in events:
        if not e.is_compute:
            continue
        lo, hi, work = out.get(e.rank, (math.inf, -math.inf, 0.0))
        out[e.rank] = (min(lo, e.start), max(hi, e.end), work + (e.end - e.start))
    return out


def measured_bubble_ratio(events: Iterable[TimelineEvent]) -> float:
    """The simulator's bubble ratio on measured events: ``(span - compute) / span`` of the longest-span rank.

    Raises:
        ValueError: no compute events.
    """
    spans = _spans(events)
    if not spans:
        raise ValueError("measured_bubble_ratio needs at least one compute event (F, B, W or BW)")
    lo, hi, work = max(spans.values(), key=lambda s: s[1] - s[0])
    return max((hi - lo - work) / (hi - lo), 0.0) if hi > lo else 0.0


def idle_breakdown(events: Iterable[TimelineEvent]) -> dict[int, dict[str, float]]:
    """Where each rank's step time went: compute, waiting in a receive, and the rest of the idle time.

    Per rank: ``span`` (first compute start to last compute end), ``compute`` (sum of compute events),
    ``recv_wait`` (receive waits between compute events, clipped to the span) and ``other`` (idle time no
    receive explains: posting and completing sends, shape headers, Python between actions). All in the
    events' unit (seconds for measured runs); ``span = compute + recv_wait + other``.
    """
    by_rank: dict[int, list[TimelineEvent]] = {}
    for e in events:
        by_rank.setdefault(e.rank, []).append(e)
    out: dict[int, dict[str, float]] = {}
    for rank, evs in sorted(by_rank.items()):
        compute = sorted((e.start, e.end) for e in evs if e.is_compute)
        if not compute:
            continue
        lo, hi = compute[0][0], max(end for _, end in compute)
        busy = sum(end - start for start, end in compute)
        gaps = [
            (a_end, b_start) for (_, a_end), (b_start, _) in itertools.pairwise(compute) if b_start > a_end
        ]
        waits = [(e.start, e.end) for e in evs if e.kind == "comm"]
        in_wait = 0.0
        for g0, g1 in gaps:
            # Union of the waits overlapping this gap (prefetched receives may overlap each other).
            in_wait += covered_length(g0, g1, waits)
        span = hi - lo
        out[rank] = {
            "span": span,
            "compute": busy,
            "recv_wait": in_wait,
            "other": max(span - busy - in_wait, 0.0),
        }
    return out


def measured_costs(
    events: Iterable[TimelineEvent], n_stages: int
) -> tuple[list[float], list[float], list[float], float]:
    """Median measured ``f``, ``b``, ``w`` per stage and the median receive wait, for :func:`simulate`.

    A stage that only ran ``BW`` gets ``b`` = its ``BW`` median and ``w = 0`` (the split is unknown).

    Returns:
        ``(f, b, w, comm)``: three per-stage lists (seconds) and one latency.
    """
    by: dict[tuple[int, str], list[float]] = {}
    comm: list[float] = []
    for e in events:
        if e.is_compute and e.stage is not None:
            by.setdefault((e.stage, e.kind), []).append(e.end - e.start)
        elif e.kind == "comm":
            comm.append(e.end - e.start)

    def med(stage: int, kind: str) -> float | None:
        values = by.get((stage, kind))
        return statistics.median(values) if values else None

    f, b, w = [], [], []
    for s in range(n_stages):
        fs, bs, ws, bws = med(s, "F"), med(s, "B"), med(s, "W"), med(s, "BW")
        f.append(fs or 0.0)
        if bs is not None:
            b.append(bs)
            w.append(ws or 0.0)
        else:
            b.append(bws or 0.0)
            w.append(0.0)
    return f, b, w, (statistics.median(comm) if comm else 0.0)


def simulate_measured(events: Iterable[TimelineEvent], schedule: Schedule) -> SimulationResult:
    """Simulate ``schedule`` with the per-stage costs measured in ``events`` (for measured-vs-simulated).

    The transfer latency is left at 0: a measured receive wait mixes latency with waiting for the
    producer, so the simulated ratio is the schedule's own bubble at the measured compute costs.
    """
    f, b, w, _ = measured_costs(events, schedule.n_stages)
    return simulate(schedule, f=f, b=b, w=w)


def bubble_report(events: Sequence[TimelineEvent], schedule: Schedule) -> str:
    """One line: the measured bubble ratio next to the simulated ones (measured per-stage costs, unit costs)
    and the replay at each action's own duration (:func:`~splitgrad.pipeline.replay.replay_measured`)."""
    measured = measured_bubble_ratio(events)
    at_costs = simulate_measured(events, schedule).bubble_ratio
    unit = simulate(schedule).bubble_ratio
    try:
        replayed = f", {100 * replay_measured(events, schedule).bubble_ratio:.1f}% replayed at each action's own duration"
    except ValueError:  # events of another schedule (e.g. the step before a planner installed its plan)
        replayed = ""
    span = max(e.end for e in events if e.is_compute) - min(e.start for e in events if e.is_compute)
    return (
        f"{schedule.name}: {schedule.n_stages} stages on {schedule.n_ranks} ranks, {schedule.n_microbatches} "
        f"microbatches, step {1e3 * span:.1f} ms: measured bubble {100 * measured:.1f}%, simulated "
        f"{100 * at_costs:.1f}% at the measured per-stage costs ({100 * unit:.1f}% at unit costs){replayed}"
    )


def save_measured_timeline(
    events: Sequence[TimelineEvent], schedule: Schedule, prefix: str | Path
) -> tuple[Path, Path | None]:
    """Write ``<prefix>.json`` (Chrome trace / Perfetto) and, when matplotlib is installed, ``<prefix>.png``.

    Returns:
        The two paths (the PNG's is None without matplotlib).
    """
    prefix = Path(prefix)
    trace = write_chrome_trace(
        events, prefix.with_suffix(".json"), us_per_unit=1e6, process_name=schedule.name
    )
    try:
        png = save_png(
            events,
            prefix.with_suffix(".png"),
            title=bubble_report(events, schedule),
            n_ranks=schedule.n_ranks,
            time_label="seconds",
        )
    except ImportError:
        logger.info("matplotlib is not installed: wrote %s only", trace)
        png = None
    return trace, png


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
