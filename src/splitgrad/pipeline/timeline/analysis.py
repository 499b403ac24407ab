"""Measured timelines read the simulator's way: bubble ratio, where idle time went, per-stage costs.

The events are :class:`~splitgrad.pipeline.timeline.events.TimelineEvent`\\ s in seconds, recorded by a runtime
(:class:`~splitgrad.pipeline.runtime.recording.TimelineRecorder`) or wrapped around another one's stage calls;
nothing here needs torch. The measured bubble ratio uses the simulator's definition (the rank with the longest
span; ``(span - compute) / span``), so measured and simulated runs compare directly.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Iterable

from ..ir.actions import Schedule
from ..ir.simulate import SimulationResult, simulate
from .events import TimelineEvent
from .replay import covered_length

__all__ = ["idle_breakdown", "measured_bubble_ratio", "measured_costs", "simulate_measured"]


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
