"""The one execution model shared by :func:`validate` and :func:`simulate`.

Each rank runs its action list strictly in order. An action starts when its rank is free and its inputs exist:

* ``F(s, i)`` needs ``F(s-1, i)``;
* ``B(s, i)`` / ``BW(s, i)`` need ``F(s, i)`` and the ``B``/``BW`` of ``(s+1, i)``;
* ``W(s, i)`` needs ``B(s, i)``;
* an :class:`~splitgrad.pipeline.ir.actions.OverlapAction` needs both parts' inputs, takes
  ``f + b - overlap * min(f, b)`` (``b`` of a ``BW`` part is ``b + w``) and delivers both outputs at its end;
* a gradient-sync point ``R`` needs nothing and takes no time; ``RF`` takes the stage's ``sync`` cost (the
  exposed part of its data-parallel reduction).

An input produced on another rank arrives ``comm`` after its producer ends. This is blocking point-to-point
with *receives* blocking and sends posted asynchronously (``isend``), which is how
``torch.distributed.pipelining`` and the splitgrad runtime execute schedules. The schedule deadlocks exactly
when some rank waits for an input that can never be produced, i.e. when no rank can make progress.

With ``durations`` every action costs its own given time instead of its stage's (the replay of a measured
step, :mod:`~splitgrad.pipeline.timeline.replay`); the dependencies and the blocking model are the same.

The loop is O(total actions): a rank runs until it blocks, registers itself under the one input it waits for,
and is woken when that input is produced. Start times depend only on already-known end times, so the order in
which ranks are advanced never changes the result.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .actions import Action, ActionKind, OverlapAction, Schedule

__all__ = ["EngineRun", "run_engine"]

_F = ActionKind.F
_B = ActionKind.B
_W = ActionKind.W
_BW = ActionKind.BW
_RF = ActionKind.RF


@dataclass(frozen=True, slots=True)
class EngineRun:
    """Outcome of :func:`run_engine`: timings when every action ran, else where each rank got stuck."""

    starts: tuple[list[float], ...]
    """``starts[r][j]`` is the start of rank ``r``'s ``j``-th action (lists are shorter if stuck)."""
    ends: tuple[list[float], ...]
    """``ends[r][j]`` is its end."""
    blocked: tuple[tuple[int, Action | OverlapAction, Action | None], ...]
    """``(rank, action, missing_input)`` per rank that could not finish; ``missing_input`` is ``None`` when
    the action is one the engine refuses to run (a duplicate, or a ``W`` whose ``(stage, microbatch)`` ran a
    full ``BW``)."""

    @property
    def completed(self) -> bool:
        """Whether every rank ran its whole list."""
        return not self.blocked


def run_engine(
    schedule: Schedule,
    f: Sequence[float],
    b: Sequence[float],
    w: Sequence[float],
    comm: float,
    *,
    sync: Sequence[float] | None = None,
    overlap: float = 0.0,
    durations: Sequence[Sequence[float]] | None = None,
) -> EngineRun:
    """Execute ``schedule`` under the blocking model with per-stage costs ``f``, ``b``, ``w``.

    The caller guarantees stage/microbatch indices are in range and each action sits on its stage's rank
    (:func:`validate` checks that first). ``BW`` costs ``b + w``; ``RF`` costs ``sync[s]`` (default 0); an
    overlapped pair hides ``overlap`` (0..1) of its shorter part. ``durations[r][j]``, when given, replaces
    the cost of rank ``r``'s ``j``-th action (any kind): a replay of measured actions under the same model.
    """
    m = schedule.n_microbatches
    n_stages = schedule.n_stages
    s2r = schedule.stage_to_rank
    rank_actions = schedule.rank_actions
    n_ranks = len(rank_actions)
    size = n_stages * m
    # Latency added to an input from the previous / next stage: comm across ranks, 0 for a local hand-off.
    from_prev = [comm if s > 0 and s2r[s - 1] != s2r[s] else 0.0 for s in range(n_stages)]
    from_next = [comm if s + 1 < n_stages and s2r[s + 1] != s2r[s] else 0.0 for s in range(n_stages)]
    bw = [b[s] + w[s] for s in range(n_stages)]
    fend: list[float | None] = [None] * size
    gend: list[float | None] = [None] * size  # end of B or BW: the input gradient exists
    split: list[bool] = [False] * size  # gend came from a B (so a W is expected)
    wdone: list[bool] = [False] * size
    wait_f: dict[int, list[int]] = {}
    wait_g: dict[int, list[int]] = {}
    ptr = [0] * n_ranks
    free = [0.0] * n_ranks
    starts: tuple[list[float], ...] = tuple([] for _ in range(n_ranks))
    ends: tuple[list[float], ...] = tuple([] for _ in range(n_ranks))
    refused: dict[int, bool] = {}
    work = list(range(n_ranks - 1, -1, -1))
    last = n_stages - 1
    F, B, W = _F, _B, _W
    sync_cost = tuple(sync) if sync is not None else (0.0,) * n_stages
    Overlap = OverlapAction

    # When an action's inputs exist, given its rank is free at t; None after parking rank r on the missing one.
    def f_ready(s: int, idx: int, t: float, r: int) -> float | None:
        """``F(s, i)`` (``idx = s * m + i``): needs ``F(s - 1, i)``."""
        if s:
            d = fend[idx - m]
            if d is None:
                wait_f.setdefault(idx - m, []).append(r)
                return None
            d += from_prev[s]
            if d > t:
                return d
        return t

    def g_ready(s: int, idx: int, t: float, r: int) -> float | None:
        """``B``/``BW(s, i)``: needs ``F(s, i)`` and the input gradient from ``(s + 1, i)``."""
        d = fend[idx]
        if d is None:
            wait_f.setdefault(idx, []).append(r)
            return None
        if d > t:
            t = d
        if s < last:
            d = gend[idx + m]
            if d is None:
                wait_g.setdefault(idx + m, []).append(r)
                return None
            d += from_next[s]
            if d > t:
                t = d
        return t

    def wake(waiting: dict[int, list[int]], idx: int) -> None:
        """Requeue the ranks parked on output ``idx``."""
        waiters = waiting.pop(idx, None)
        if waiters:
            work.extend(waiters)

    while work:
        r = work.pop()
        acts = rank_actions[r]
        n_acts = len(acts)
        p = ptr[r]
        t = free[r]
        st_append = starts[r].append
        en_append = ends[r].append
        own = None if durations is None else durations[r]
        while p < n_acts:
            a = acts[p]
            if a.__class__ is Overlap:
                fs, _, fi = a.forward
                bs, bk, bi = a.backward
                fidx, bidx = fs * m + fi, bs * m + bi
                ready = f_ready(fs, fidx, t, r)
                if ready is None or (ready := g_ready(bs, bidx, ready, r)) is None:
                    break
                if fend[fidx] is not None or gend[bidx] is not None:
                    refused[r] = True
                    break
                cf, cb = f[fs], (b[bs] if bk is B else bw[bs])
                e = ready + (cf + cb - overlap * (cf if cf < cb else cb) if own is None else own[p])
                fend[fidx] = e
                gend[bidx] = e
                split[bidx] = bk is B
                wake(wait_f, fidx)
                wake(wait_g, bidx)
            else:
                s, k, i = a
                if i is None:  # gradient-sync point: no inputs
                    ready = t
                    e = t + (own[p] if own is not None else sync_cost[s] if k is _RF else 0.0)
                elif k is F:
                    idx = s * m + i
                    if (ready := f_ready(s, idx, t, r)) is None:
                        break
                    if fend[idx] is not None:
                        refused[r] = True
                        break
                    e = ready + (f[s] if own is None else own[p])
                    fend[idx] = e
                    if wait_f:
                        wake(wait_f, idx)
                elif k is W:
                    idx = s * m + i
                    d = gend[idx]
                    if d is None:
                        wait_g.setdefault(idx, []).append(r)
                        break
                    if not split[idx] or wdone[idx]:
                        refused[r] = True
                        break
                    ready = d if d > t else t
                    e = ready + (w[s] if own is None else own[p])
                    wdone[idx] = True
                else:  # B or BW
                    idx = s * m + i
                    if (ready := g_ready(s, idx, t, r)) is None:
                        break
                    if gend[idx] is not None:
                        refused[r] = True
                        break
                    if k is B:
                        e = ready + (b[s] if own is None else own[p])
                        split[idx] = True
                    else:
                        e = ready + (bw[s] if own is None else own[p])
                    gend[idx] = e
                    if wait_g:
                        wake(wait_g, idx)
            st_append(ready)
            en_append(e)
            t = e
            p += 1
        ptr[r] = p
        free[r] = t

    blocked = []
    for r in range(n_ranks):
        p = ptr[r]
        if p == len(rank_actions[r]):
            continue
        action = rank_actions[r][p]
        missing = None if refused.get(r) else _missing_input(action, fend, gend, m, last)
        blocked.append((r, action, missing))
    return EngineRun(starts=starts, ends=ends, blocked=tuple(blocked))


def _missing_input(
    action: Action | OverlapAction, fend: list[float | None], gend: list[float | None], m: int, last: int
) -> Action | None:
    """The input ``action`` is blocked on (named as the action that would produce it)."""
    if type(action) is OverlapAction:
        fs, _, fi = action.forward
        if fs and fend[(fs - 1) * m + fi] is None:
            return Action(fs - 1, _F, fi)
        return _missing_input(action.backward, fend, gend, m, last)
    s, k, i = action
    idx = s * m + i
    if k is _F:
        return Action(s - 1, _F, i)
    if k is _W:
        return Action(s, _B, i)
    if fend[idx] is None:
        return Action(s, _F, i)
    if s < last and gend[idx + m] is None:
        return Action(s + 1, _B, i)
    return None
