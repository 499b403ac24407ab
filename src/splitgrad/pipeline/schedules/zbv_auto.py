"""zbv-auto: a cost-aware ZB-V from F/B/W/comm costs under a per-rank memory limit.

The fixed :func:`~splitgrad.pipeline.schedules.zbv.zbv` pattern is bubble-free when ``F = B = W`` and transfers
are free; when the costs differ (or ``comm > 0``) its ranks wait. The zero-bubble paper's ZB-V (Qi et al.,
ICLR 2024, section 6) instead builds the V greedily from the costs and keeps the best of a few settings.
zbv-auto does the same with the list scheduler it shares with zb-auto, on the V placement (rank ``r`` holds
stage ``r`` on the way down and ``2p - 1 - r`` on the way back up): whenever a rank is free it picks, from what
could run *now*,

* an input gradient ``B`` (on the critical path; the down-stage one first by default: it is further along
  its microbatch's backward chain and frees a whole activation), alternating with forwards as in 1F1B
  when both are ready;
* a forward ``F``, the up-stage one first (it brings its microbatch to the loss sooner), if the rank holds
  room for one more activation and the down stage is under its warm-up cap;
* otherwise a pending weight gradient ``W`` — always (``fill="eager"``), or only when it ends before the
  next input can arrive (``fill="fit"``) or when the rank is at its memory limit;
* otherwise it waits.

That choice is :class:`_ZbvPlanner`'s ``choose``; the event loop, the pass's state and the memory model are in
``_list_scheduler.py``.

:func:`zbv_auto` runs this for several in-flight depths, fill rules and priorities, adds the fixed ``zbv``,
then re-places the ``W`` of the best few plans' cool-downs (and of the fixed V throughout) with
:func:`~splitgrad.pipeline.passes.refill_w`: in the paper's settings the fixed V loses its bubble
at the end, where it runs a ``W`` while an input gradient other ranks wait for is ready. Every candidate is
simulated under the given costs and memory model and the best is returned (shortest longest-rank span, then
makespan, then lower peak). Because the fixed ``zbv`` is a candidate whenever it fits the memory limit (it
does at the default ``2p``), zbv-auto is never worse than ``zbv`` at the same memory. A greedy pass that
stalls (memory full on every rank that could unblock another) is dropped, not returned.

Below the fixed V's ``2p`` activations the greedy passes with the V's depths stall: a low rank spends its
whole budget on down-stage forwards and never runs the up-stage forward its first input gradient needs. So
under a smaller limit zbv-auto adds the building-block schedules :func:`~.v_half.v_half` and
:func:`~.v_min.v_min` (about a half and a third of the memory) and greedy passes whose depths split the limit
between the two stages (the up stage gets half or a third). V-Min's peak, ``2 * floor((p + 4) / 3)`` stage
activations with enough microbatches, is the least a building block reaches; below it (down to 2, one
activation per stage) only the split greedy passes fit, and the bubble grows steeply (1.5B costs, p = 8,
m = 24: 0.34 at V-Min's 8, 0.48 at 7, 0.81 at 2).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from ..ir._coerce import per_rank_memory_limits
from ..ir._perf import gc_paused
from ..ir.actions import ActionKind, Schedule
from ..ir.simulate import Costs, simulate
from ..passes.w_refill import refill_w
from ._candidates import Candidate, CandidatePool, pick_best
from ._common import check_choice, check_v_shape, v_mapping
from ._list_scheduler import PassState, PlanCosts, Run, Wait, list_schedule
from ._search import GreedySearch
from .v_half import v_half
from .v_min import v_min
from .zbv import zbv

__all__ = ["ZbvCandidate", "zbv_auto", "zbv_auto_candidates", "zbv_greedy"]

logger = logging.getLogger(__name__)

_F, _B, _W = ActionKind.F, ActionKind.B, ActionKind.W
_EPS = 1e-9
_INF = math.inf
_SLACKS = (0.0, 0.5, 1.0, math.inf)
_REFILL_BASES = 4  # how far a filling W may run past the next input (in W costs)


def _limits(memory_limit: float | Sequence[float] | None, p: int) -> tuple[float, ...]:
    """Per-rank limits in stage activations ``M_B`` (default ``2p``: the fixed ZB-V's peak)."""
    return per_rank_memory_limits(
        "zbv-auto", memory_limit, p, default=2 * p, minimum=2,
        unit="in stage activations M_B; a rank holds two stages",
    )  # fmt: skip


@gc_paused()
def zbv_greedy(
    n_stages: int,
    n_microbatches: int,
    *,
    f: Costs = 1.0,
    b: Costs = 1.0,
    w: Costs = 1.0,
    comm: float = 0.0,
    memory_limit: float | Sequence[float] | None = None,
    w_memory: float = 1.0,
    down_cap: Sequence[int] | None = None,
    up_cap: Sequence[int] | None = None,
    fill: str = "eager",
    alternate: bool = True,
    down_b_first: bool = True,
    strict: bool = False,
) -> Schedule | None:
    """One greedy list-scheduling pass on the V placement (see the module docstring).

    Args:
        n_stages: model stages (even; ``n_stages / 2`` ranks).
        n_microbatches: microbatches.
        f, b, w: per-stage costs (one value or one per stage).
        comm: transfer latency between ranks (the V's turn on the last rank is local).
        memory_limit: most activation memory a rank may hold, in stage activations ``M_B`` (``F`` adds 1,
            ``B`` frees ``1 - w_memory``, ``W`` the rest); default ``n_stages`` (= ``2p``).
        w_memory: ``M_W / M_B`` (see :func:`splitgrad.pipeline.simulate`).
        down_cap: per-rank cap on down-stage microbatches in flight (``F`` done, ``B`` not); default
            ``2p - 1 - r`` on rank ``r``, what the fixed ZB-V holds at its first ``B``.
        up_cap: the same for the up stage; default ``r + 1``. Like 1F1B's warm-up depth, the caps keep
            each stage's forwards from running ahead of its backwards, which keeps the V deadlock-free.
        fill: ``"eager"``: a pending ``W`` runs whenever nothing else is ready; ``"fit"``: only if it ends
            before the next input can arrive, or memory is full.
        alternate: alternate ``F`` and ``B`` when both are ready (else ``B`` first).
        down_b_first: when both stages' ``B`` are ready, run the down stage's first.
        strict: after a rank's first ``B``, strictly alternate ``B`` and ``F`` (waiting for the one that is
            due, filling the wait with ``W``) instead of running whatever is ready.

    Returns:
        A valid schedule within ``memory_limit``, or None when the pass stalls under the limit.

    Raises:
        ValueError: odd ``n_stages``, bad costs, limits or options.
    """
    check_v_shape("zbv-auto", n_stages, n_microbatches)
    check_choice("zbv-auto", "fill", fill, ("eager", "fit"))
    p, m, n = n_stages // 2, n_microbatches, n_stages
    costs = PlanCosts.of("zbv-auto", n, f=f, b=b, w=w, comm=comm, w_memory=w_memory)
    limits = _limits(memory_limit, p)
    dcap = tuple(2 * p - 1 - r for r in range(p)) if down_cap is None else tuple(down_cap)
    ucap = tuple(r + 1 for r in range(p)) if up_cap is None else tuple(up_cap)
    for what, caps in (("down_cap", dcap), ("up_cap", ucap)):
        if len(caps) != p or any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in caps):
            raise ValueError(
                f"zbv-auto: {what} must give one integer cap >= 1 per rank ({p} ranks), got {caps}"
            )
    rank_of = v_mapping(p)
    planner = _ZbvPlanner(costs, m, limits, dcap, ucap, rank_of, fill, alternate, down_b_first, strict)
    state = PassState(n, p, m, costs)
    if not list_schedule(planner, state):
        return None  # stalled: every rank that could free memory waits on one that cannot
    return Schedule(
        name="zbv-auto",
        n_microbatches=m,
        stage_to_rank=rank_of,
        rank_actions=tuple(map(tuple, state.actions)),
    )


@dataclass(frozen=True, slots=True)
class _ZbvPlanner:
    """zbv-auto's choice for a free rank ``r`` (it holds the down stage ``r`` and the up stage ``2p - 1 - r``);
    see the module docstring for the rules."""

    fifo_ties: ClassVar[bool] = False
    wake_idle_only: ClassVar[bool] = False
    costs: PlanCosts
    m: int
    limits: tuple[float, ...]
    dcap: tuple[int, ...]
    """Per rank, down-stage microbatches in flight at most."""
    ucap: tuple[int, ...]
    """Per rank, up-stage microbatches in flight at most."""
    rank_of: tuple[int, ...]
    fill: str
    alternate: bool
    down_b_first: bool
    strict: bool

    def choose(self, st: PassState, r: int, t: float) -> Run | Wait:
        nf, nb, m = st.nf, st.nb, self.m
        down, up = r, len(self.rank_of) - 1 - r
        room = st.live[r] + 1.0 <= self.limits[r] + _EPS
        # Candidates as (ready time, stage), in priority order within a kind.
        fs = []
        for s in (up, down):
            if nf[s] < m and room and nf[s] - nb[s] < (self.ucap[r] if s == up else self.dcap[r]):
                fs.append((self._ready_f(st, s), s))
        bs = []
        for s in (down, up) if self.down_b_first else (up, down):
            if nb[s] < nf[s]:
                bs.append((self._ready_b(st, s), s))
        if self.strict and nb[up] + nb[down] > 0 and fs and bs:
            # A down-stage B waits for this rank's own up-stage F of the same microbatch: not due yet.
            bs = [(tr, x) for tr, x in bs if x == up or nb[down] < nf[up]]
            # After the warm-up, one B then one F, as 1F1B: wait for the kind that is due (filling with W).
            if st.last_was_f[r] and bs:
                fs = []
            else:
                bs = []
        f_now = [s for tr, s in fs if tr <= t]
        b_now = [s for tr, s in bs if tr <= t]
        if b_now and (not f_now or st.last_was_f[r] or not self.alternate):
            return Run(_B, b_now[0])
        if f_now:
            return Run(_F, f_now[0])
        pending = st.pending[r]
        if pending:
            next_in = min([tr for tr, _ in fs] + [tr for tr, _ in bs], default=_INF)
            memory_bound = not room and any(nf[x] < m for x in (up, down))
            w = self.costs.w[pending[0][0]]
            if self.fill == "eager" or memory_bound or next_in >= t + w or next_in == _INF:
                return Run(_W, -1)
            return Wait(next_in, True)
        known = [tr for tr, _ in fs + bs if tr < _INF]
        # Without a known time, a producer's wake-up brings this rank back.
        return Wait(min(known) if known else None, True)

    def consumer(
        self, st: PassState, kind: ActionKind, s: int, start: float, end: float
    ) -> tuple[int, float] | None:
        if kind is _F:
            c = s + 1 if s + 1 < len(self.rank_of) else s  # the last stage's own B needs its F
        elif kind is _B and s > 0:
            c = s - 1
        else:
            return None
        r = self.rank_of[c]
        return r, max(end + self._latency(s, c), st.free[r])

    def _latency(self, src: int, dst: int) -> float:
        return 0.0 if self.rank_of[src] == self.rank_of[dst] else self.costs.comm

    def _ready_f(self, st: PassState, s: int) -> float:
        """When the next ``F`` of stage ``s`` has its input (inf: producer not scheduled yet)."""
        return 0.0 if s == 0 else st.fend[s - 1][st.nf[s]] + self._latency(s - 1, s)

    def _ready_b(self, st: PassState, s: int) -> float:
        i = st.nb[s]
        if s == len(self.rank_of) - 1:
            return st.fend[s][i]
        return max(st.fend[s][i], st.bend[s + 1][i] + self._latency(s + 1, s))


ZbvCandidate = Candidate
"""One schedule zbv-auto considered: ``(label, schedule, result)`` (the shared :class:`Candidate`)."""


@gc_paused()
def zbv_auto_candidates(
    n_stages: int,
    n_microbatches: int,
    *,
    f: Costs = 1.0,
    b: Costs = 1.0,
    w: Costs = 1.0,
    comm: float = 0.0,
    memory_limit: float | Sequence[float] | None = None,
    w_memory: float = 1.0,
) -> list[ZbvCandidate]:
    """Every candidate zbv-auto weighs (greedy variants and the fixed ``zbv`` if it fits), best first."""
    check_v_shape("zbv-auto", n_stages, n_microbatches)
    p, m = n_stages // 2, n_microbatches
    limits = _limits(memory_limit, p)
    costs = PlanCosts.of("zbv-auto", n_stages, f=f, b=b, w=w, comm=comm, w_memory=w_memory)
    pool = CandidatePool(costs, limits)
    search = GreedySearch(zbv_greedy, n_stages, m, pool)
    consider = pool.consider

    fixed = zbv(n_stages, n_microbatches)
    consider("zbv", Schedule("zbv-auto", m, fixed.stage_to_rank, fixed.rank_actions))
    # In-flight caps per stage (down, up): the fixed V's depth, one deeper on either stage (room the paper's
    # memory model frees when w_memory < 1), and the fixed V's depth shifted towards the up stage.
    base_d = [2 * p - 1 - r for r in range(p)]
    base_u = [r + 1 for r in range(p)]
    depths = {
        "zbv-depth": (base_d, base_u),
        "deeper-down": ([d + 1 for d in base_d], base_u),
        "deeper-up": (base_d, [u + 1 for u in base_u]),
        "deeper-both": ([d + 1 for d in base_d], [u + 1 for u in base_u]),
    }
    for dname, (dcap, ucap) in depths.items():
        for fill in ("eager", "fit"):
            for order in ("strict", "alternate", "b-first"):
                for down_b_first in (True, False):
                    label = (
                        f"greedy({dname}, fill={fill}, {order}, {'down' if down_b_first else 'up'}-b-first)"
                    )
                    search.greedy(
                        label,
                        down_cap=dcap,
                        up_cap=ucap,
                        fill=fill,
                        alternate=order != "b-first",
                        down_b_first=down_b_first,
                        strict=order == "strict",
                    )

    if min(limits) < 2 * p:
        _add_small_memory_candidates(pool, search, p, m)

    # The best few plans' cool-downs re-placed (input gradients first, W into the waits), and the fixed V's W
    # re-placed throughout: F/B order kept, so validity and in-flight depth are the base's. Only the best
    # _REFILL_BASES greedy plans: re-placing the W of a poor F/B order does not make it a good one.
    candidates = pool.ranked()
    bases = candidates[:_REFILL_BASES] + [c for c in candidates[_REFILL_BASES:] if c.label == "zbv"]
    for base in bases:
        variants = [(s, True) for s in _SLACKS] + (
            [(s, False) for s in _SLACKS] if base.label == "zbv" else []
        )
        for slack, tail_only in variants:
            refilled = refill_w(
                base.schedule,
                costs.f,
                costs.b,
                costs.w,
                costs.comm,
                limits=limits,
                w_memory=w_memory,
                slack=slack,
                tail_only=tail_only,
            )
            consider(f"{base.label} + refill_w(slack={slack}{', tail' if tail_only else ''})", refilled)

    return pool.ranked()


def _add_small_memory_candidates(pool: CandidatePool, search: GreedySearch, p: int, m: int) -> None:
    """Candidates for limits below the fixed V's ``2p``: V-Half, V-Min, and greedy passes whose in-flight depths
    split each rank's limit between its stages (the pool drops what does not fit)."""
    n = 2 * p
    for name, build in (("v-half", v_half), ("v-min", v_min)):
        block = build(n, m)
        pool.consider(name, Schedule("zbv-auto", m, block.stage_to_rank, block.rank_actions))
    # Whole activations a rank may hold (at least one per stage); the memory check still applies per pass.
    held = [max(2, math.floor(limit + _EPS)) for limit in pool.limits]
    for share, up_of in (("half", lambda h: h // 2), ("third", lambda h: max(1, h // 3))):
        ucap = [up_of(h) for h in held]
        dcap = [h - u for h, u in zip(held, ucap)]
        for fill in ("eager", "fit"):
            for strict in (False, True):
                search.greedy(
                    f"greedy(split-{share}, fill={fill}, {'strict' if strict else 'alternate'})",
                    down_cap=dcap,
                    up_cap=ucap,
                    fill=fill,
                    strict=strict,
                )


def zbv_auto(
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
    """Best ZB-V-placed schedule for the given costs within ``memory_limit`` stage activations per rank
    (default ``n_stages`` = ``2p``, the fixed ``zbv``'s peak). See :func:`zbv_auto_candidates`.

    Args:
        n_stages: model stages (even; ``n_stages / 2`` ranks, two stages each in a V).
        n_microbatches: microbatches per step.
        f, b, w: per-stage forward / input-gradient / weight-gradient costs (one value or one per stage).
        comm: transfer latency between ranks.
        memory_limit: activation budget per rank in stage activations ``M_B`` (one number or one per rank),
            at least 2; below V-Min's peak only the split greedy passes fit (see the module doc).
        w_memory: ``M_W / M_B``, what a ``B`` keeps for its ``W`` (the paper's memory model).

    Returns:
        The best candidate schedule, named ``"zbv-auto"``.

    Raises:
        ValueError: odd ``n_stages``, bad costs or limits, or no candidate fits ``memory_limit`` (the message
            gives V-Min's per-rank peak for comparison).
    """
    candidates = zbv_auto_candidates(
        n_stages, n_microbatches, f=f, b=b, w=w, comm=comm, memory_limit=memory_limit, w_memory=w_memory
    )
    if not candidates:
        least = simulate(v_min(n_stages, n_microbatches), w_memory=w_memory).peak_memory
        raise ValueError(
            f"zbv-auto: no schedule fits {memory_limit=} stage activations per rank ({n_stages=} "
            f"{n_microbatches=} {w_memory=}); raise memory_limit (V-Min's peak is {list(least)} per rank)"
        )
    return pick_best(candidates, "zbv-auto", "unreachable: candidates checked above")
