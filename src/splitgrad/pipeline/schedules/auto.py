"""zb-auto: a greedy zero-bubble schedule from measured F/B/W costs under a per-rank memory limit.

Following the zero-bubble paper's heuristic (Qi et al., ICLR 2024, section 3.1), each rank, whenever it is
free, picks its next action from what it could run *now* in a list-scheduling simulation:

* an input gradient ``B`` whose upstream gradient has arrived comes first (it is on the critical path);
  when a forward is also ready the two alternate, as in 1F1B;
* a forward ``F`` runs if its input has arrived and the rank holds fewer than ``memory_limit`` activations
  (before its first ``B`` a rank also stops at a warm-up cap);
* otherwise a pending weight gradient ``W`` fills the gap — always (``fill="eager"``), or only if it ends
  before the next input can arrive (``fill="fit"``);
* otherwise the rank waits.

That choice is :class:`_ZbPlanner`'s ``choose``; the event loop, the pass's state and the memory model are the
list scheduler zb-auto shares with zbv-auto (``_list_scheduler.py``). Memory follows the paper's model (Table 1): ``F`` holds one activation ``M_B``, ``B`` frees all but
``M_W = w_memory * M_B``, ``W`` the rest; ``memory_limit`` is in units of ``M_B``. With ``w_memory < 1`` a
limit of ``2p`` leaves room for deeper warm-ups; the ``zb-2p-warmup`` candidates use it but stop a rank's
warm-up where a forward would hold up the first input gradient on its way back up.

:func:`zb_auto` runs this for a few warm-up caps, fill and alternation rules, adds the hand-written 1F1B
(split), ZB-H1 and ZB-H2 when they fit the memory limit, simulates every candidate with the given costs and
returns the best (shortest longest-rank span, then makespan, then lower peak memory). Because ZB-H1 is among
the candidates whenever the limit allows ``p`` activations, zb-auto is never worse than ZB-H1 at the same memory.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar

from ..ir._coerce import per_rank_memory_limits
from ..ir._perf import gc_paused
from ..ir.actions import ActionKind, Schedule
from ..ir.simulate import Costs
from ._candidates import Candidate, CandidatePool, pick_best, spans_key
from ._common import check_choice, check_positive_int, loop_mapping
from ._list_scheduler import PassState, PlanCosts, Run, Wait, list_schedule
from ._search import GreedySearch
from .gpipe_1f1b import one_f_one_b
from .zero_bubble import zb_h1, zb_h2

__all__ = ["AutoCandidate", "auto_candidates", "greedy_schedule", "zb_auto"]

logger = logging.getLogger(__name__)

_F, _B, _W = ActionKind.F, ActionKind.B, ActionKind.W
_EPS = 1e-9
_GUARD_RANKS = 8  # the guard search tries ranks below this: further from rank 0 a W delays fewer ranks


def _memory_limits(memory_limit: float | Sequence[float] | None, p: int) -> tuple[float, ...]:
    """Per-rank limits in units of one stage activation ``M_B`` (default ``p``: 1F1B's peak)."""
    return per_rank_memory_limits("zb-auto", memory_limit, p, default=p, minimum=1, unit="in activations M_B")


@gc_paused()
def greedy_schedule(
    n_stages: int,
    n_microbatches: int,
    *,
    f: Costs = 1.0,
    b: Costs = 1.0,
    w: Costs = 1.0,
    comm: float = 0.0,
    memory_limit: float | Sequence[float] | None = None,
    w_memory: float = 1.0,
    warmup: Sequence[int] | None = None,
    fill: str = "eager",
    alternate: bool = True,
    warmup_deadline: float | None = None,
    w_guard: Sequence[bool] | None = None,
) -> Schedule:
    """One greedy list-scheduling pass (see the module docstring); one stage per rank.

    Args:
        n_stages: stages = ranks.
        n_microbatches: microbatches.
        f, b, w: per-stage costs (one value or one per stage).
        comm: transfer latency between ranks.
        memory_limit: most activation memory a rank may hold, in units of one activation ``M_B`` (``F``
            adds 1, ``B`` frees ``1 - w_memory``, ``W`` the rest); default ``n_stages``.
        w_memory: ``M_W / M_B``, what a ``B`` keeps for its ``W`` (see :func:`splitgrad.pipeline.simulate`).
        warmup: per-rank cap on forwards before the rank's first ``B`` (default: the memory limit).
        fill: ``"eager"`` runs a pending ``W`` whenever nothing else is ready; ``"fit"`` only when it ends
            before the next input can arrive; ``"reserve"`` as eager while more than one ``W`` is pending, then
            as fit (one ``W`` kept back to fill a later wait: at the memory limit a rank can otherwise starve).
        alternate: when both an ``F`` and a ``B`` are ready, alternate them (else ``B`` always first).
        warmup_deadline: also stop a rank's warm-up forwards (before its first ``B``) once one would end
            later than ``warmup_deadline`` forward costs after the earliest moment its first input gradient
            can arrive (forward chain down, backward chain up), so warm-up never delays that gradient on
            its way back (rank 0 keeps its warm-up: nothing waits for it). None: no such stop.
        w_guard: per rank, whether it may start a ``W`` only when that ``W`` ends before the rank's next input
            gradient can arrive (else it waits for the gradient): a rank that runs a ``W`` while the gradient
            arrives holds up the backward chain to every rank above it. None: no rank guarded.

    Returns:
        A valid schedule whose peak activations respect ``memory_limit``.
    """
    check_positive_int("zb-auto", n_stages=n_stages, n_microbatches=n_microbatches)
    check_choice("zb-auto", "fill", fill, ("eager", "fit", "reserve"))
    p, m = n_stages, n_microbatches
    costs = PlanCosts.of("zb-auto", p, f=f, b=b, w=w, comm=comm, w_memory=w_memory)
    limits = _memory_limits(memory_limit, p)
    caps = tuple(int(x) for x in limits) if warmup is None else tuple(warmup)
    if len(caps) != p or any(c < 1 for c in caps):
        raise ValueError(f"zb-auto: warmup must give one cap >= 1 per rank, got {warmup=}")
    guarded = (False,) * p if w_guard is None else tuple(bool(g) for g in w_guard)
    if len(guarded) != p:
        raise ValueError(f"zb-auto: w_guard must give one flag per rank ({p} ranks), got {w_guard=}")
    # Earliest arrival of each rank's first input gradient: microbatch 0 down every stage and back up.
    fc, bc, comm_ = costs.f, costs.b, costs.comm
    down = sum(fc) + (p - 1) * comm_
    first_grad = tuple(down + sum(bc[s + 1 :]) + (p - 1 - s) * comm_ for s in range(p))
    planner = _ZbPlanner(costs, m, limits, caps, guarded, first_grad, fill, alternate, warmup_deadline)
    state = PassState(p, p, m, costs)  # stage s on rank s
    if not list_schedule(planner, state):  # pragma: no cover - the rules always make progress; guards edits
        stuck = [s for s in range(p) if len(state.actions[s]) != 3 * m]
        raise RuntimeError(f"zb-auto greedy pass stalled on ranks {stuck} ({n_stages=} {n_microbatches=})")
    return Schedule(
        name="zb-auto", n_microbatches=m, stage_to_rank=loop_mapping(p, p), rank_actions=tuple(state.actions)
    )


@dataclass(frozen=True, slots=True)
class _ZbPlanner:
    """zb-auto's choice for a free rank ``s`` (it holds stage ``s``); see the module docstring for the rules."""

    fifo_ties: ClassVar[bool] = True
    wake_idle_only: ClassVar[bool] = True
    costs: PlanCosts
    m: int
    limits: tuple[float, ...]
    caps: tuple[int, ...]
    """Per rank, the forwards it may run before its first ``B``."""
    guarded: tuple[bool, ...]
    """Per rank, whether a ``W`` must end before the next input gradient can arrive."""
    first_grad: tuple[float, ...]
    """Per rank, the earliest arrival of its first input gradient."""
    fill: str
    alternate: bool
    warmup_deadline: float | None

    def choose(self, st: PassState, s: int, t: float) -> Run | Wait:
        nf, nb, m, fc = st.nf, st.nb, self.m, self.costs.f
        f_allowed = (
            nf[s] < m and st.live[s] + 1.0 <= self.limits[s] + _EPS and (nb[s] > 0 or nf[s] < self.caps[s])
        )
        deadline = self.warmup_deadline
        if (
            f_allowed
            and deadline is not None
            and s > 0
            and nb[s] == 0
            and nf[s] > 0
            and t + fc[s] > self.first_grad[s] + deadline * fc[s]
        ):
            f_allowed = False
        b_allowed = nb[s] < nf[s]
        pending = st.pending[s]
        if not (f_allowed or b_allowed or pending):
            # Blocked by memory with nothing to free: wait for a B (its producer's action wakes this rank).
            return Wait(None, nf[s] < m or nb[s] < m)
        tf, lf = self._arrival(st, s, _F, t) if f_allowed else (None, math.inf)
        tb, lb = self._arrival(st, s, _B, t) if b_allowed else (None, math.inf)
        f_now = tf is not None and tf <= t
        b_now = tb is not None and tb <= t
        if b_now and f_now:
            return Run(_B if (st.last_was_f[s] or not self.alternate) else _F, s)
        if b_now:
            return Run(_B, s)
        if f_now:
            return Run(_F, s)
        w = self.costs.w[s]
        if (
            pending
            and (not self.guarded[s] or lb >= t + w)
            and (
                self.fill == "eager"
                or (self.fill == "reserve" and len(pending) > 1)
                or min(lf, lb) >= t + w
                or not (f_allowed or b_allowed)
            )
        ):
            return Run(_W, s)
        known = [x for x in (tf, tb) if x is not None]
        return Wait(min(known) if known else None, len(known) < int(f_allowed) + int(b_allowed))

    def consumer(
        self, st: PassState, kind: ActionKind, s: int, start: float, end: float
    ) -> tuple[int, float] | None:
        # The rank whose input this action produced: if it waits on a producer, it may now run.
        neighbour = s + 1 if kind is _F else s - 1 if kind is _B else -1
        return (neighbour, start) if 0 <= neighbour < len(self.caps) else None

    def _arrival(self, st: PassState, s: int, kind: ActionKind, now: float) -> tuple[float | None, float]:
        """(known arrival time or None, lower bound) of the input the next ``kind`` of ``s`` needs."""
        comm = self.costs.comm
        if kind is _F:
            if s == 0:
                return 0.0, 0.0
            t = st.fend[s - 1][st.nf[s]]
            if t < math.inf:  # producer already scheduled
                return t + comm, t + comm
            return None, max(st.free[s - 1], now) + self.costs.f[s - 1] + comm
        i = st.nb[s]
        if s == len(self.caps) - 1:
            return st.fend[s][i], st.fend[s][i]
        t = st.bend[s + 1][i]
        if t < math.inf:
            return t + comm, t + comm
        return None, max(st.free[s + 1], now) + self.costs.b[s + 1] + comm


AutoCandidate = Candidate
"""One schedule zb-auto considered: ``(label, schedule, result)`` (the shared :class:`Candidate`)."""


@gc_paused()
def auto_candidates(
    n_stages: int,
    n_microbatches: int,
    *,
    f: Costs = 1.0,
    b: Costs = 1.0,
    w: Costs = 1.0,
    comm: float = 0.0,
    memory_limit: float | Sequence[float] | None = None,
    w_memory: float = 1.0,
    tune: bool = True,
) -> list[AutoCandidate]:
    """Every candidate zb-auto weighs (greedy variants and fitting hand-written schedules), best first.

    With ``tune`` the best greedy plan's settings are refined by a local search over which ranks guard
    their input gradients (``w_guard`` of :func:`greedy_schedule`): one pass over the ranks nearest the
    first stage (at most 8; those whose gradients every rank above waits for), guarding one more rank at a
    time and keeping it guarded when that shortens the rank spans (compared longest first). It is skipped
    when the longest rank never idles after its first ``B`` (nothing a guard could win). Deterministic.
    """
    check_positive_int("zb-auto", n_stages=n_stages, n_microbatches=n_microbatches)
    p, m = n_stages, n_microbatches
    limits = _memory_limits(memory_limit, p)
    costs = PlanCosts.of("zb-auto", p, f=f, b=b, w=w, comm=comm, w_memory=w_memory)
    pool = CandidatePool(costs, limits)
    search = GreedySearch(greedy_schedule, p, m, pool)
    greedy = search.greedy

    warmups = {
        "1f1b-warmup": tuple(min(int(limits[s]), p - s) for s in range(p)),
        "zb-h2-warmup": tuple(min(int(limits[s]), 2 * (p - s) - 1) for s in range(p)),
        "max-warmup": tuple(int(x) for x in limits),
    }
    for (wname, caps), fill, alternate in itertools.product(warmups.items(), ("eager", "fit"), (True, False)):
        label = f"greedy({wname}, fill={fill}, {'alternate' if alternate else 'b-first'})"
        greedy(label, warmup=caps, fill=fill, alternate=alternate)
    # With room for more than 2p - 1 activations (the paper's ZB-2p under its memory model), warm up one
    # forward deeper but stop where a forward would hold up the first input gradient on its way back.
    deep = tuple(min(int(limits[s]), 2 * (p - s)) for s in range(p))
    for deadline, fill in (
        itertools.product((0.0, 0.5), ("eager", "reserve")) if max(limits) >= 2 * p - 1 else ()
    ):
        label = f"greedy(zb-2p-warmup, deadline={deadline}, fill={fill})"
        greedy(label, warmup=deep, warmup_deadline=deadline, fill=fill)
    for label, builder in (("1f1b-split", None), ("zb-h1", zb_h1), ("zb-h2", zb_h2)):
        base = one_f_one_b(p, m, split_backward=True) if builder is None else builder(p, m)
        pool.consider(label, Schedule("zb-auto", m, base.stage_to_rank, base.rank_actions))

    best = search.best_greedy()
    if tune and best is not None and p > 1 and _steady_idle(best) > _EPS:
        _tune_w_guard(best, search.settings[best.label], p, greedy)  # its trials join the pool
    return pool.ranked()


def _steady_idle(c: AutoCandidate) -> float:
    """Idle time of the longest rank after its first ``B``: what a guard could win back (the wait for the
    first input gradient is set by the warm-up, not by ``W`` placement)."""
    spans = [hi - lo for lo, hi in c.result.rank_spans]
    r = max(range(len(spans)), key=spans.__getitem__)
    acts, starts, ends = c.schedule.rank_actions[r], c.result.starts[r], c.result.ends[r]
    first_b = next((j for j, a in enumerate(acts) if a.kind is _B), len(acts))
    return sum(max(0.0, starts[j] - ends[j - 1]) for j in range(first_b + 1, len(acts)))


def _tune_w_guard(
    best: AutoCandidate, options: dict, p: int, greedy: Callable[..., AutoCandidate | None]
) -> AutoCandidate | None:
    """One coordinate-descent pass over the guards of ranks ``0 .. min(p/2, 8) - 1`` (see
    :func:`auto_candidates`); the best plan found, or None when no guard helps."""
    guard = [False] * p
    current: AutoCandidate | None = None
    score = spans_key(best)
    for s in range(max(1, min(p // 2, _GUARD_RANKS))):
        trial = guard.copy()
        trial[s] = True
        ranks = [r for r in range(p) if trial[r]]
        found = greedy(f"{best.label} + w_guard(ranks={ranks})", **options, w_guard=tuple(trial))
        if found is not None and spans_key(found) < score:
            guard, current, score = trial, found, spans_key(found)
    if current is not None:
        logger.debug("zb-auto: guarding ranks %s improves %s", [r for r in range(p) if guard[r]], best.label)
    return current


def zb_auto(
    n_stages: int,
    n_microbatches: int,
    *,
    f: Costs = 1.0,
    b: Costs = 1.0,
    w: Costs = 1.0,
    comm: float = 0.0,
    memory_limit: float | Sequence[float] | None = None,
    w_memory: float = 1.0,
) -> Schedule:
    """Best schedule for the given costs within ``memory_limit`` activations per rank (default ``n_stages``,
    1F1B's and ZB-H1's peak). See :func:`auto_candidates` for everything it compares."""
    candidates = auto_candidates(
        n_stages, n_microbatches, f=f, b=b, w=w, comm=comm, memory_limit=memory_limit, w_memory=w_memory
    )
    return pick_best(
        candidates, "zb-auto", f"zb-auto: no schedule fits {memory_limit=} ({n_stages=} {n_microbatches=})"
    )
