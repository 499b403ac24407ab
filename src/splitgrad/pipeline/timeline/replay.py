"""Replay a measured step through the simulator and attribute the rest of its span to the runtime.

``simulate_measured`` costs every action at its stage's *median*, so measured minus simulated mixes the
runtime's own overhead with compute jitter (one slow ``W`` delays everything that depends on it, which a
median cannot see). :func:`replay_measured` removes the jitter: the same schedule, through the simulator's
engine, each action costed with *its own* measured duration in that step, starting as soon as its rank is
free and its inputs exist (plus ``comm`` per cross-rank transfer, 0 by default). What the replay does not
explain is the runtime's cost.

:func:`overhead_split` attributes it per rank. Every gap between two consecutive compute actions of a rank
(measured) is cut at ``ready``, the moment the later action's last cross-rank input was produced (its
producer's measured end):

* before ``ready``: ``producer_wait``, the rank waited for a producer that had not finished;
* after ``ready``, inside a receive wait: ``transport``, the data existed but was not in hand yet (posting
  late, the transfer, waking up);
* after ``ready``, inside a gradient-sync point (``R``/``RF``): ``sync``;
* the rest: ``dispatch``, the runtime's Python between actions (posting sends and receives, bookkeeping).

The replay's own idle time (``replay_idle``: its waits for producers, and its sync points) is what the
schedule costs at these durations. So, exactly, per rank::

    span - replay_span = dispatch + transport + propagated,
    propagated = producer_wait + sync - replay_idle

``propagated`` is waiting beyond the replay's: a producer that finished later than in the replay because of
overhead on *its* rank (it may be negative). Only clock order within one host is used (``time.perf_counter``
after a barrier), not how long anything took on a loaded machine, so the split holds under load.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from ..ir._engine import run_engine
from ..ir.actions import ActionKind, AnyAction, Schedule
from ..ir.validate import validate
from .events import COMPUTE_KINDS, TimelineEvent

__all__ = ["RankOverhead", "ReplayResult", "overhead_split", "replay_measured"]

_SYNC_KINDS = (ActionKind.R.value, ActionKind.RF.value)
_ACTION_KINDS = COMPUTE_KINDS + _SYNC_KINDS


@dataclass(frozen=True, slots=True)
class ReplayResult:
    """A measured step replayed at its own per-action durations."""

    starts: tuple[tuple[float, ...], ...]
    """``starts[r][j]``: replayed start of ``schedule.rank_actions[r][j]`` (the step's first action at 0)."""
    ends: tuple[tuple[float, ...], ...]
    """Replayed ends."""
    rank_spans: tuple[float, ...]
    """Per rank: first compute start to last compute end, replayed (sync points at either end excluded, as
    in the measured span)."""
    rank_compute: tuple[float, ...]
    """Per rank: the sum of its compute actions' measured durations (the same in the replay)."""
    bubble_ratio: float
    """``(span - compute) / span`` of the longest-span rank, as :func:`measured_bubble_ratio` defines it."""


@dataclass(frozen=True, slots=True)
class RankOverhead:
    """One rank's measured span next to its replay, in the events' unit (seconds for a measured run)."""

    span: float
    """Measured: first compute start to last compute end."""
    replay_span: float
    """The same in the replay."""
    compute: float
    """Sum of compute durations (equal in both)."""
    dispatch: float
    """Idle with every input produced and no receive wait or sync point running: Python between actions."""
    transport: float
    """Inside a receive wait after the producer had finished: posting late, the transfer itself."""
    sync: float
    """Inside a gradient-sync point (``R``/``RF``) after the inputs existed."""
    producer_wait: float
    """Waiting for an input whose producer had not finished (measured)."""
    replay_idle: float
    """``replay_span - compute``: the replay's waits for producers and its sync points."""

    @property
    def overhead(self) -> float:
        """``span - replay_span``: what the runtime added over the replay."""
        return self.span - self.replay_span

    @property
    def propagated(self) -> float:
        """``producer_wait + sync - replay_idle``: waits beyond the replay's, caused on other ranks."""
        return self.producer_wait + self.sync - self.replay_idle


def _match(events: Sequence[TimelineEvent], schedule: Schedule) -> list[list[TimelineEvent]]:
    """Each rank's action events in schedule order; ``ValueError`` when they are not the schedule's actions."""
    by_rank: list[list[TimelineEvent]] = [[] for _ in range(schedule.n_ranks)]
    for e in events:
        if e.kind in _ACTION_KINDS:
            if not 0 <= e.rank < schedule.n_ranks:
                raise ValueError(
                    f"event {e.name!r} on rank {e.rank}: schedule {schedule.name!r} has {schedule.n_ranks} ranks"
                )
            by_rank[e.rank].append(e)
    for r, (evs, acts) in enumerate(zip(by_rank, schedule.rank_actions, strict=True)):
        evs.sort(key=lambda e: e.start)
        names = [e.name for e in evs]
        expected = [a.name for a in acts]
        if names != expected:
            first = next(
                (j for j, (a, b) in enumerate(zip(names, expected)) if a != b), min(len(names), len(expected))
            )
            raise ValueError(
                f"replay: rank {r} recorded {len(names)} actions, schedule {schedule.name!r} has {len(expected)}; "
                f"they differ at position {first}: recorded {names[first : first + 3]}, scheduled "
                f"{expected[first : first + 3]} (one step of this schedule, with record_timeline=True?)"
            )
    return by_rank


def _compute_span(
    acts: Sequence[AnyAction], starts: Sequence[float], ends: Sequence[float]
) -> tuple[float, float]:
    """``(span, compute)`` over the compute actions only."""
    compute = [(s, e) for a, s, e in zip(acts, starts, ends) if a.kind.value in COMPUTE_KINDS]
    if not compute:
        return 0.0, 0.0
    return compute[-1][1] - compute[0][0], sum(e - s for s, e in compute)


def replay_measured(
    events: Sequence[TimelineEvent], schedule: Schedule, *, comm: float = 0.0
) -> ReplayResult:
    """Replay one measured step of ``schedule`` at its own per-action durations (the simulator's engine).

    Args:
        events: every rank's events of one step (e.g. ``runtime.gather_timeline(result)``), seconds.
        schedule: the schedule that ran (``runtime.schedule``: with its sync points, if lowered).
        comm: latency added to every cross-rank input in the replay (0: a transfer takes no time, so the
            transport shows up as overhead).

    Returns:
        A :class:`ReplayResult`.

    Raises:
        ValueError: the events are not exactly one step of ``schedule`` per rank, or ``comm`` is negative.
        ScheduleError: ``schedule`` is invalid.
    """
    if not comm >= 0.0:
        raise ValueError(f"replay_measured: comm must be a non-negative latency, got {comm=}")
    validate(schedule)
    matched = _match(events, schedule)
    durations = [[e.end - e.start for e in evs] for evs in matched]
    zeros = [0.0] * schedule.n_stages
    run = run_engine(schedule, zeros, zeros, zeros, float(comm), durations=durations)
    if not run.completed:  # pragma: no cover - validate() accepted it, so the engine runs it all
        raise RuntimeError(f"replay: the engine blocked on {run.blocked}")
    spans, compute = zip(
        *(_compute_span(acts, st, en) for acts, st, en in zip(schedule.rank_actions, run.starts, run.ends))
    )
    critical = max(range(schedule.n_ranks), key=spans.__getitem__)
    span = spans[critical]
    bubble = max((span - compute[critical]) / span, 0.0) if span > 0 else 0.0
    return ReplayResult(
        starts=tuple(map(tuple, run.starts)),
        ends=tuple(map(tuple, run.ends)),
        rank_spans=tuple(spans),
        rank_compute=tuple(compute),
        bubble_ratio=bubble,
    )


def covered_length(lo: float, hi: float, intervals: Sequence[tuple[float, float]]) -> float:
    """Length of ``[lo, hi]`` covered by the union of ``intervals``."""
    clipped = sorted((max(a, lo), min(b, hi)) for a, b in intervals if b > lo and a < hi)
    total, cur0, cur1 = 0.0, None, None
    for a, b in clipped:
        if cur1 is None or a > cur1:
            total += 0.0 if cur1 is None else cur1 - cur0
            cur0, cur1 = a, b
        else:
            cur1 = max(cur1, b)
    return total + (0.0 if cur1 is None else cur1 - cur0)


def overhead_split(
    events: Sequence[TimelineEvent], schedule: Schedule, replay: ReplayResult | None = None
) -> list[RankOverhead]:
    """Per rank, the measured span against the replay's, with the runtime's overhead split (module docstring).

    Args:
        events: every rank's events of one step (seconds).
        schedule: the schedule that ran.
        replay: :func:`replay_measured` of the same events (computed when omitted).

    Returns:
        One :class:`RankOverhead` per rank; ``overhead == dispatch + transport + propagated`` exactly.
    """
    replay = replay_measured(events, schedule) if replay is None else replay
    matched = _match(events, schedule)
    # When each (stage, microbatch, is-forward) output was produced, measured (an overlapped pair: its end).
    produced: dict[tuple[int, int, bool], float] = {}
    for acts, evs in zip(schedule.rank_actions, matched):
        for action, e in zip(acts, evs):
            for part in action.parts:
                if part.kind is not ActionKind.W and part.microbatch is not None:
                    produced[(part.stage, part.microbatch, part.kind is ActionKind.F)] = e.end
    out = []
    for r, (acts, evs) in enumerate(zip(schedule.rank_actions, matched)):
        waits = [(e.start, e.end) for e in events if e.rank == r and e.kind == "comm"]
        syncs = [(e.start, e.end) for e in evs if e.kind in _SYNC_KINDS]
        compute = [(a, e) for a, e in zip(acts, evs) if e.kind in COMPUTE_KINDS]
        dispatch = transport = sync = producer_wait = 0.0
        for (_, prev), (action, e) in itertools.pairwise(compute):
            gap_lo, gap_hi = prev.end, e.start
            if gap_hi <= gap_lo:
                continue
            ready = max(
                (
                    produced[(t.src_stage, t.microbatch, t.kind == "activation")]
                    for t in schedule.receives(action)
                ),
                default=gap_lo,
            )
            after = min(max(ready, gap_lo), gap_hi)
            producer_wait += after - gap_lo
            moved = covered_length(after, gap_hi, waits)
            synced = covered_length(after, gap_hi, syncs)
            transport += moved
            sync += synced
            dispatch += gap_hi - after - moved - synced
        span, busy = _compute_span(acts, [e.start for e in evs], [e.end for e in evs])
        out.append(
            RankOverhead(
                span=span,
                replay_span=replay.rank_spans[r],
                compute=busy,
                dispatch=dispatch,
                transport=transport,
                sync=sync,
                producer_wait=producer_wait,
                replay_idle=replay.rank_spans[r] - replay.rank_compute[r],
            )
        )
    return out
