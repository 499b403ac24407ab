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

Memory follows the paper's model (Table 1): ``F`` holds one activation ``M_B``, ``B`` frees all but
``M_W = w_memory * M_B``, ``W`` the rest; ``memory_limit`` is in units of ``M_B``. With ``w_memory < 1`` a
limit of ``2p`` leaves room for deeper warm-ups; the ``zb-2p-warmup`` candidates use it but stop a rank's
warm-up where a forward would hold up the first input gradient on its way back up.

:func:`zb_auto` runs this for a few warm-up caps, fill and alternation rules, adds the hand-written 1F1B
(split), ZB-H1 and ZB-H2 when they fit the memory limit, simulates every candidate with the given costs and
returns the best (shortest longest-rank span, then makespan, then lower peak memory). Because ZB-H1 is among
the candidates whenever the limit allows ``p`` activations, zb-auto is never worse than ZB-H1 at the same memory.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
from collections.abc import Callable, Sequence

from ..ir._coerce import per_rank_memory_limits
from ..ir._perf import gc_paused
from ..ir.actions import ActionKind, Schedule
from ..ir.simulate import Costs, check_w_memory, stage_costs
from ._candidates import Candidate, CandidatePool, pick_best, spans_key
from ._common import check_choice, check_positive_int, loop_mapping
from ._greedy import PassState
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
    fc, bc, wc = stage_costs(f, p, "f"), stage_costs(b, p, "b"), stage_costs(w, p, "w")
    limits = _memory_limits(memory_limit, p)
    r_w = check_w_memory(w_memory, "zb-auto")
    caps = tuple(int(x) for x in limits) if warmup is None else tuple(warmup)
    if len(caps) != p or any(c < 1 for c in caps):
        raise ValueError(f"zb-auto: warmup must give one cap >= 1 per rank, got {warmup=}")
    guarded = (False,) * p if w_guard is None else tuple(bool(g) for g in w_guard)
    if len(guarded) != p:
        raise ValueError(f"zb-auto: w_guard must give one flag per rank ({p} ranks), got {w_guard=}")

    # Earliest arrival of each rank's first input gradient: microbatch 0 down every stage and back up.
    down = sum(fc) + (p - 1) * comm
    first_grad = [down + sum(bc[s + 1 :]) + (p - 1 - s) * comm for s in range(p)]
    state = PassState(p, p, m, fc, bc, wc, r_w)  # stage s on rank s
    fend, bend, nf, nb, free = state.fend, state.bend, state.nf, state.nb, state.free
    live, last_was_f, pending, actions = state.live, state.last_was_f, state.pending, state.actions
    version = [0] * p
    sleeping = [False] * p
    heap: list[tuple[float, int, int, int]] = []
    seq = 0

    def push(t: float, s: int) -> None:
        nonlocal seq
        version[s] += 1
        sleeping[s] = False
        heapq.heappush(heap, (t, seq, s, version[s]))
        seq += 1

    def arrival(s: int, kind: ActionKind, now: float) -> tuple[float | None, float]:
        """(known arrival time or None, lower bound) of the input the next ``kind`` of ``s`` needs."""
        if kind is _F:
            i = nf[s]
            if s == 0:
                return 0.0, 0.0
            t = fend[s - 1][i]
            if t < math.inf:  # producer already scheduled
                return t + comm, t + comm
            return None, max(free[s - 1], now) + fc[s - 1] + comm
        i = nb[s]
        if s == p - 1:
            return fend[s][i], fend[s][i]
        t = bend[s + 1][i]
        if t < math.inf:
            return t + comm, t + comm
        return None, max(free[s + 1], now) + bc[s + 1] + comm

    for s in range(p):
        push(0.0, s)
    while heap:
        now, _, s, ver = heapq.heappop(heap)
        if ver != version[s]:
            continue
        t = max(now, free[s])
        f_allowed = nf[s] < m and live[s] + 1.0 <= limits[s] + _EPS and (nb[s] > 0 or nf[s] < caps[s])
        if (
            f_allowed
            and warmup_deadline is not None
            and s > 0
            and nb[s] == 0
            and nf[s] > 0
            and t + fc[s] > first_grad[s] + warmup_deadline * fc[s]
        ):
            f_allowed = False
        b_allowed = nb[s] < nf[s]
        if not (f_allowed or b_allowed or pending[s]):
            if nf[s] < m or nb[s] < m:  # blocked by memory with nothing to free: wait for a B
                sleeping[s] = True
            continue
        tf, lf = arrival(s, _F, t) if f_allowed else (None, math.inf)
        tb, lb = arrival(s, _B, t) if b_allowed else (None, math.inf)
        f_now = tf is not None and tf <= t
        b_now = tb is not None and tb <= t
        if b_now and f_now:
            choice = _B if (last_was_f[s] or not alternate) else _F
        elif b_now:
            choice = _B
        elif f_now:
            choice = _F
        elif (
            pending[s]
            and (not guarded[s] or lb >= t + wc[s])
            and (
                fill == "eager"
                or (fill == "reserve" and len(pending[s]) > 1)
                or min(lf, lb) >= t + wc[s]
                or not (f_allowed or b_allowed)
            )
        ):
            choice = _W
        else:
            known = [x for x in (tf, tb) if x is not None]
            if known:
                push(min(known), s)
            if len(known) < int(f_allowed) + int(b_allowed):
                sleeping[s] = True
            continue
        _, end = state.run(s, choice, s, t)
        # The rank whose input this action produced: a sleeping one may now run.
        neighbour = s + 1 if choice is _F else s - 1 if choice is _B else -1
        if nf[s] < m or nb[s] < m or pending[s]:
            push(end, s)
        if 0 <= neighbour < p and sleeping[neighbour]:
            push(t, neighbour)

    stuck = [s for s in range(p) if len(actions[s]) != 3 * m]
    if stuck:  # pragma: no cover - the rules above always make progress; this guards future edits
        raise RuntimeError(f"zb-auto greedy pass stalled on ranks {stuck} ({n_stages=} {n_microbatches=})")
    return Schedule(
        name="zb-auto", n_microbatches=m, stage_to_rank=loop_mapping(p, p), rank_actions=tuple(actions)
    )


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
    pool = CandidatePool(f, b, w, comm, limits=limits, w_memory=w_memory)
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
