"""Time a schedule with per-stage costs: makespan, the zero-bubble paper's bubble ratio, peak activations.

Execution model (shared with :func:`splitgrad.pipeline.validate`): ranks run their lists in order; an action
starts when its rank is free and its inputs exist (``F(s-1, i)`` for ``F``; ``F(s, i)`` and the backward of
``(s+1, i)`` for ``B``/``BW``; ``B(s, i)`` for ``W``), an input from another rank arriving ``comm`` after its
producer ends. ``BW`` costs ``b + w``.

Bubble ratio (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024): take the rank with the longest span
(its first action's start to its last action's end) as the cost; ``bubble_ratio = (cost - work) / cost`` where
``work`` is that rank's compute, ``m * (f + b + w)`` summed over the stages it holds.

Memory model (the paper's Table 1): ``F(s, i)`` allocates one activation (``M_B``), ``B(s, i)`` frees all but
what its ``W`` needs (``M_W = w_memory * M_B``), ``W(s, i)`` (or a ``BW``) frees the rest. ``w_memory = 1.0``
(the default) keeps the whole activation until ``W``, an upper bound; the paper's transformer layer has
``M_W / M_B = 32h / (34h + 5as)``, about 0.37-0.43. ``peak_memory[r]`` is rank ``r``'s peak in units of
``M_B``; ``peak_activations[r]`` counts ``(stage, microbatch)`` activations held at once (``F`` done, ``W``/``BW``
not), the same number when ``w_memory = 1``. With several stages per rank each stage holds a fraction of the
layers, so compare those figures scaled by the stage size.

Gradient-sync points cost nothing (``R``) or the stage's ``sync`` cost (``RF``); an overlapped ``F+B`` action
costs ``f + b - overlap * min(f, b)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate
from operator import itemgetter
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ._coerce import as_cost, as_costs
from ._engine import run_engine
from ._perf import gc_paused
from .actions import ActionKind, OverlapAction, Schedule

if TYPE_CHECKING:
    from ..timeline.events import TimelineEvent

# The timeline room builds on this module (it simulates measured costs), so the events and renderers a result
# hands its timeline to are imported where they are used, once both rooms have loaded.

# stage_costs and check_w_memory are the argument checks the cost-aware schedules share (pipeline-internal).
__all__ = ["Costs", "SimulationResult", "simulate"]

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


def check_w_memory(w_memory: float, where: str) -> float:
    """``w_memory`` as a float in ``[0, 1]``, else ``ValueError`` naming ``where``."""
    try:
        value = float(w_memory)
    except (TypeError, ValueError):
        raise ValueError(f"{where}: w_memory must be a number in [0, 1], got {w_memory!r}") from None
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{where}: w_memory (M_W / M_B) must be in [0, 1], got {w_memory=}")
    return value


def memory_deltas(w_memory: float) -> dict[ActionKind, float]:
    """Change of a rank's activation memory (units of ``M_B``) per action kind under ``w_memory``."""
    return {
        ActionKind.F: 1.0,
        ActionKind.B: w_memory - 1.0,
        ActionKind.W: -w_memory,
        ActionKind.BW: -1.0,
        ActionKind.R: 0.0,
        ActionKind.RF: 0.0,
    }


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
    peak_memory: tuple[float, ...] = ()
    """Peak activation memory per rank in units of ``M_B`` under :attr:`w_memory`."""
    w_memory: float = 1.0
    """``M_W / M_B`` used for :attr:`peak_memory`."""

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
        from ..timeline.events import TimelineEvent

        sched = self.schedule
        out: list[TimelineEvent] = []
        produced: dict[tuple[int, int, bool], float] = {}
        for r, acts in enumerate(sched.rank_actions):
            for action, start, end in zip(acts, self.starts[r], self.ends[r]):
                out.append(TimelineEvent.from_action(r, action, start, end))
                for part in action.parts:
                    if part.kind is not ActionKind.W and part.microbatch is not None:
                        produced[(part.stage, part.microbatch, part.kind is ActionKind.F)] = end
        if self.comm > 0:
            for r, acts in enumerate(sched.rank_actions):
                for action in acts:
                    for transfer in sched.receives(action):
                        key = (transfer.src_stage, transfer.microbatch, transfer.kind == "activation")
                        sent = produced[key]
                        label = f"recv {'act' if transfer.kind == 'activation' else 'grad'} {action.name}"
                        out.append(TimelineEvent(r, label, sent, sent + self.comm, "comm"))
        return out

    def to_ascii(self, **kwargs: Any) -> str:
        """ASCII grid of the timeline; keyword arguments go to :func:`~splitgrad.pipeline.timeline.render_ascii`."""
        kwargs.setdefault("n_ranks", self.schedule.n_ranks)
        kwargs.setdefault("compact", self.schedule.n_stages == self.schedule.n_ranks)
        from ..timeline.render import render_ascii

        return render_ascii(self.events(), **kwargs)

    def to_chrome_trace(self, **kwargs: Any) -> dict[str, Any]:
        """Chrome-trace / Perfetto JSON object; see :func:`~splitgrad.pipeline.timeline.to_chrome_trace`."""
        from ..timeline.render import to_chrome_trace

        return to_chrome_trace(self.events(), **kwargs)

    def save_png(self, path: str | Path, **kwargs: Any) -> Path:
        """Gantt chart PNG (needs matplotlib); the title carries the bubble ratio."""
        kwargs.setdefault("title", self.title())
        kwargs.setdefault("n_ranks", self.schedule.n_ranks)
        from ..timeline.render import save_png

        return save_png(self.events(), path, **kwargs)

    def title(self) -> str:
        """One-line summary used as the chart title."""
        s = self.schedule
        return (
            f"{s.name}: {s.n_stages} stages on {s.n_ranks} ranks, {s.n_microbatches} microbatches, "
            f"bubble {100 * self.bubble_ratio:.1f}%, peak activations {max(self.peak_activations)}"
            + (f" (memory {max(self.peak_memory):.2f} M_B)" if self.w_memory != 1.0 else "")
        )


@gc_paused()
def simulate(
    schedule: Schedule,
    f: Costs = 1.0,
    b: Costs = 1.0,
    w: Costs = 1.0,
    comm: float = 0.0,
    *,
    sync: Costs = 0.0,
    overlap: float = 0.0,
    w_memory: float = 1.0,
) -> SimulationResult:
    """Simulate ``schedule`` with forward / input-gradient / weight-gradient costs per stage.

    Args:
        schedule: the schedule to time.
        f: forward cost, one value for every stage or one per stage (any time unit).
        b: input-gradient (``B``) cost; a full ``BW`` costs ``b + w``.
        w: weight-gradient (``W``) cost.
        comm: latency of a point-to-point transfer between different ranks (same unit).
        sync: exposed cost of a stage's gradient-sync finish point ``RF`` (0: reductions fully hidden).
        overlap: fraction (0..1) of the shorter part of an overlapped ``F+B`` action hidden behind the
            longer one (0: the parts cost their sum, as if run one after the other).
        w_memory: ``M_W / M_B``, the fraction of an activation a ``B`` keeps for its ``W`` (memory report).

    Returns:
        A :class:`SimulationResult`.

    Raises:
        ScheduleError: the schedule is invalid (see :func:`splitgrad.pipeline.validate`).
        ValueError: bad costs (bools, NaN/inf, negatives, non-numbers; numpy scalars are accepted).
    """
    n = schedule.n_stages
    fc, bc, wc = stage_costs(f, n, "f"), stage_costs(b, n, "b"), stage_costs(w, n, "w")
    comm = as_cost("comm", comm)
    sc = stage_costs(sync, n, "sync")
    overlap = as_cost("overlap", overlap)
    if overlap > 1.0:
        raise ValueError(f"simulate: overlap must be a fraction in [0, 1], got {overlap=}")
    w_memory = check_w_memory(w_memory, "simulate")
    from .validate import check_structure, validate

    check_structure(schedule)
    run = run_engine(schedule, fc, bc, wc, float(comm), sync=sc, overlap=float(overlap))
    if not run.completed:
        validate(schedule)  # raises with the full explanation
        raise AssertionError(
            "unreachable: engine blocked on a schedule validate() accepts"
        )  # pragma: no cover
    result, n_units = _summarise(schedule, run.starts, run.ends, fc, bc, wc, float(comm), w_memory)
    # The engine refuses duplicates, so a complete schedule has exactly 3 n m units of work (BW counts 2).
    if n_units != 3 * schedule.n_stages * schedule.n_microbatches:
        validate(schedule)  # a missing action: validate names it
    elif n_units != _compute_units(schedule):
        validate(schedule)  # sync points or overlapped pairs: validate checks their placement
    return result


def _compute_units(schedule: Schedule) -> int:
    """Units of compute if every entry were a plain compute action (BW counts 2), to spot special ones."""
    kinds = [k for acts in schedule.rank_actions for k in map(_kind_of, acts)]
    return len(kinds) + kinds.count(ActionKind.BW)


def _summarise(
    schedule: Schedule,
    starts: tuple[list[float], ...],
    ends: tuple[list[float], ...],
    fc: tuple[float, ...],
    bc: tuple[float, ...],
    wc: tuple[float, ...],
    comm: float,
    w_memory: float = 1.0,
) -> tuple[SimulationResult, int]:
    """Spans, work, peaks; also returns the units of compute seen (``BW`` counts 2; completeness check)."""
    m = schedule.n_microbatches
    n_ranks = schedule.n_ranks
    rank_spans = tuple((st[0], en[-1]) if st else (0.0, 0.0) for st, en in zip(starts, ends))
    rank_work = [0.0] * n_ranks
    for s, r in enumerate(schedule.stage_to_rank):
        rank_work[r] += m * (fc[s] + bc[s] + wc[s])
    # Live activations: +1 at F, -1 at W or BW; the per-rank peak is the running sum's maximum.
    count = {ActionKind.F: 1, ActionKind.B: 0, ActionKind.W: -1, ActionKind.BW: -1, ActionKind.R: 0}
    count[ActionKind.RF] = 0
    delta = count.__getitem__
    mem = memory_deltas(w_memory).__getitem__
    units = {ActionKind.BW: 2, ActionKind.R: 0, ActionKind.RF: 0}
    peaks, mem_peaks = [], []
    n_units = 0
    stage_spans: list[tuple[float, float]] = [(0.0, 0.0)] * schedule.n_stages
    for r, acts in enumerate(schedule.rank_actions):
        plain = all(type(a) is not OverlapAction for a in acts)
        # Overlapped pairs count as their two parts (F first: the conservative order for the peak).
        flat = acts if plain else [p for a in acts for p in a.parts]
        starts_r = starts[r] if plain else [t for a, t in zip(acts, starts[r]) for _ in a.parts]
        ends_r = ends[r] if plain else [t for a, t in zip(acts, ends[r]) for _ in a.parts]
        kinds = list(map(_kind_of, flat))
        n_units += sum(units.get(k, 1) for k in kinds)
        peaks.append(max(0, *accumulate(map(delta, kinds))) if kinds else 0)
        mem_peaks.append(max(0.0, *accumulate(map(mem, kinds))) if kinds else 0.0)
        stages = list(map(_stage_of, flat))
        for s in schedule.stages_of(r):
            if s in stages:
                first = stages.index(s)
                last = len(stages) - 1 - stages[::-1].index(s)
                stage_spans[s] = (starts_r[first], ends_r[last])
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
        peak_memory=tuple(round(x, 12) for x in mem_peaks),
        w_memory=w_memory,
    )
    return result, n_units
