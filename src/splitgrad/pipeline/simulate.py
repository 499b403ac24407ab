"""Time a schedule with per-stage costs: makespan, the zero-bubble paper's bubble ratio, peak activations.

Execution model (shared with :func:`splitgrad.pipeline.validate`): ranks run their lists in order; an action
starts when its rank is free and its inputs exist (``F(s-1, i)`` for ``F``; ``F(s, i)`` and the backward of
``(s+1, i)`` for ``B``/``BW``; ``B(s, i)`` for ``W``), an input from another rank arriving ``comm`` after its
producer ends. ``BW`` costs ``b + w``.

Bubble ratio (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024): take the rank with the longest span
(its first action's start to its last action's end) as the cost; ``bubble_ratio = (cost - work) / cost`` where
``work`` is that rank's compute, ``m * (f + b + w)`` summed over the stages it holds.

Memory model: an activation is allocated by ``F(s, i)`` and held until ``W(s, i)`` (or ``BW(s, i)``) frees it.
This is the paper's ``M_B`` retained until the weight gradient; in reality ``B`` already frees part of it, so
the count is an upper bound. ``peak_activations[r]`` is the largest number of such ``(stage, microbatch)``
activations rank ``r`` holds at once. With several stages per rank each stage holds a fraction of the
layers, so compare those counts scaled by the stage size.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate
from operator import itemgetter
from pathlib import Path
from typing import Any

from ._coerce import as_cost, as_costs
from ._engine import run_engine
from ._perf import gc_paused
from .actions import ActionKind, Schedule
from .timeline import TimelineEvent, render_ascii, save_png, to_chrome_trace

__all__ = ["Costs", "SimulationResult", "simulate", "stage_costs"]

Costs = float | Sequence[float]
_stage_of, _kind_of = itemgetter(0), itemgetter(1)
"""One cost for every stage, or one per stage (length ``n_stages``)."""


def stage_costs(value: Costs, n_stages: int, what: str) -> tuple[float, ...]:
    """Expand ``value`` to one finite non-negative float per stage.

    Raises:
        ValueError: wrong length, negative, not finite, or not a real number (numpy scalars are fine); the
            message names ``what``.
    """
    value = as_costs(f"{what} costs", value)
    if isinstance(value, float):
        return (value,) * n_stages
    if len(value) != n_stages:
        raise ValueError(f"{what} needs one cost per stage: got {len(value)} values for {n_stages=}")
    return value


@dataclass(frozen=True, slots=True)
class SimulationResult:
    """Timing of every action of a schedule under one cost model."""

    schedule: Schedule
    """The schedule that was simulated."""
    starts: tuple[tuple[float, ...], ...]
    """``starts[r][j]``: start of ``schedule.rank_actions[r][j]``."""
    ends: tuple[tuple[float, ...], ...]
    """``ends[r][j]``: its end."""
    comm: float
    """Transfer latency used between ranks."""
    makespan: float
    """Last end minus first start over all ranks."""
    bubble_ratio: float
    """``(cost - work) / cost`` on the rank with the longest span (0 when nothing takes time)."""
    rank_spans: tuple[tuple[float, float], ...]
    """``(first start, last end)`` per rank."""
    rank_work: tuple[float, ...]
    """Compute per rank, ``m * (f + b + w)`` summed over its stages."""
    stage_spans: tuple[tuple[float, float], ...]
    """``(first start, last end)`` over each stage's actions."""
    peak_activations: tuple[int, ...]
    """Largest number of live activations (``F`` done, ``W``/``BW`` not) per rank."""

    @property
    def rank_bubble_ratios(self) -> tuple[float, ...]:
        """``(span - work) / span`` of every rank (``bubble_ratio`` is the longest-span rank's)."""
        return tuple(
            (hi - lo - work) / (hi - lo) if hi > lo else 0.0
            for (lo, hi), work in zip(self.rank_spans, self.rank_work)
        )

    def events(self) -> list[TimelineEvent]:
        """One :class:`TimelineEvent` per action, plus one ``"comm"`` event per cross-rank transfer when
        ``comm > 0`` (drawn on the receiving rank, from the producer's end to the arrival)."""
        sched = self.schedule
        out: list[TimelineEvent] = []
        produced: dict[tuple[int, int, bool], float] = {}
        for r, acts in enumerate(sched.rank_actions):
            for action, start, end in zip(acts, self.starts[r], self.ends[r]):
                out.append(TimelineEvent.from_action(r, action, start, end))
                if action.kind is not ActionKind.W:
                    produced[(action.stage, action.microbatch, action.kind is ActionKind.F)] = end
        if self.comm > 0:
            for r, acts in enumerate(sched.rank_actions):
                for action in acts:
                    transfer = sched.recv_before(action)
                    if transfer is None:
                        continue
                    key = (transfer.src_stage, transfer.microbatch, transfer.kind == "activation")
                    sent = produced[key]
                    label = f"recv {'act' if transfer.kind == 'activation' else 'grad'} {action.name}"
                    out.append(TimelineEvent(r, label, sent, sent + self.comm, "comm"))
        return out

    def to_ascii(self, **kwargs: Any) -> str:
        """ASCII grid of the timeline; keyword arguments go to :func:`~splitgrad.pipeline.render_ascii`."""
        kwargs.setdefault("n_ranks", self.schedule.n_ranks)
        kwargs.setdefault("compact", self.schedule.n_stages == self.schedule.n_ranks)
        return render_ascii(self.events(), **kwargs)

    def to_chrome_trace(self, **kwargs: Any) -> dict[str, Any]:
        """Chrome-trace / Perfetto JSON object; see :func:`~splitgrad.pipeline.to_chrome_trace`."""
        return to_chrome_trace(self.events(), **kwargs)

    def save_png(self, path: str | Path, **kwargs: Any) -> Path:
        """Gantt chart PNG (needs matplotlib); the title carries the bubble ratio."""
        kwargs.setdefault("title", self.title())
        kwargs.setdefault("n_ranks", self.schedule.n_ranks)
        return save_png(self.events(), path, **kwargs)

    def title(self) -> str:
        """One-line summary used as the chart title."""
        s = self.schedule
        return (
            f"{s.name}: {s.n_stages} stages on {s.n_ranks} ranks, {s.n_microbatches} microbatches, "
            f"bubble {100 * self.bubble_ratio:.1f}%, peak activations {max(self.peak_activations)}"
        )


@gc_paused()
def simulate(
    schedule: Schedule,
    f: Costs = 1.0,
    b: Costs = 1.0,
    w: Costs = 1.0,
    comm: float = 0.0,
) -> SimulationResult:
    """Simulate ``schedule`` with forward / input-gradient / weight-gradient costs per stage.

    Args:
        schedule: the schedule to time.
        f: forward cost, one value for every stage or one per stage (any time unit).
        b: input-gradient (``B``) cost; a full ``BW`` costs ``b + w``.
        w: weight-gradient (``W``) cost.
        comm: latency of a point-to-point transfer between different ranks (same unit).

    Returns:
        A :class:`SimulationResult`.

    Raises:
        ScheduleError: the schedule is invalid (see :func:`splitgrad.pipeline.validate`).
        ValueError: bad costs (bools, NaN/inf, negatives, non-numbers; numpy scalars are accepted).
    """
    n = schedule.n_stages
    fc, bc, wc = stage_costs(f, n, "f"), stage_costs(b, n, "b"), stage_costs(w, n, "w")
    comm = as_cost("comm", comm)
    from .validate import check_structure, validate

    check_structure(schedule)
    run = run_engine(schedule, fc, bc, wc, float(comm))
    if not run.completed:
        validate(schedule)  # raises with the full explanation
        raise AssertionError(
            "unreachable: engine blocked on a schedule validate() accepts"
        )  # pragma: no cover
    result, n_full_backward = _summarise(schedule, run.starts, run.ends, fc, bc, wc, float(comm))
    # The engine refuses duplicates, so a complete schedule has exactly 3 n m units of work (BW counts 2).
    if schedule.n_actions + n_full_backward != 3 * schedule.n_stages * schedule.n_microbatches:
        validate(schedule)  # a missing action: validate names it
    return result


def _summarise(
    schedule: Schedule,
    starts: tuple[list[float], ...],
    ends: tuple[list[float], ...],
    fc: tuple[float, ...],
    bc: tuple[float, ...],
    wc: tuple[float, ...],
    comm: float,
) -> tuple[SimulationResult, int]:
    """Spans, work, peaks; also returns the number of ``BW`` actions (for the completeness check)."""
    m = schedule.n_microbatches
    n_ranks = schedule.n_ranks
    rank_spans = tuple((st[0], en[-1]) if st else (0.0, 0.0) for st, en in zip(starts, ends))
    rank_work = [0.0] * n_ranks
    for s, r in enumerate(schedule.stage_to_rank):
        rank_work[r] += m * (fc[s] + bc[s] + wc[s])
    # Live activations: +1 at F, -1 at W or BW; the per-rank peak is the running sum's maximum.
    delta = {ActionKind.F: 1, ActionKind.B: 0, ActionKind.W: -1, ActionKind.BW: -1}.__getitem__
    peaks = []
    n_full_backward = 0
    stage_spans: list[tuple[float, float]] = [(0.0, 0.0)] * schedule.n_stages
    for r, acts in enumerate(schedule.rank_actions):
        kinds = list(map(_kind_of, acts))
        n_full_backward += kinds.count(ActionKind.BW)
        peaks.append(max(0, *accumulate(map(delta, kinds))) if kinds else 0)
        stages = list(map(_stage_of, acts))
        for s in schedule.stages_of(r):
            if s in stages:
                first = stages.index(s)
                last = len(stages) - 1 - stages[::-1].index(s)
                stage_spans[s] = (starts[r][first], ends[r][last])
    span_lengths = [hi - lo for lo, hi in rank_spans]
    critical = max(range(n_ranks), key=span_lengths.__getitem__)
    cost = span_lengths[critical]
    bubble = (cost - rank_work[critical]) / cost if cost > 0 else 0.0
    makespan = max(hi for _, hi in rank_spans) - min(lo for lo, _ in rank_spans)
    result = SimulationResult(
        schedule=schedule,
        starts=tuple(tuple(st) for st in starts),
        ends=tuple(tuple(en) for en in ends),
        comm=comm,
        makespan=makespan,
        bubble_ratio=max(bubble, 0.0),
        rank_spans=rank_spans,
        rank_work=tuple(rank_work),
        stage_spans=tuple(stage_spans),
        peak_activations=tuple(peaks),
    )
    return result, n_full_backward
