"""Re-place a schedule's weight gradients ``W`` for given costs, keeping every rank's F/B order.

A ``W`` feeds no other action, so where it runs only matters to its own rank: it can fill a wait for the next
``F``/``B`` input, or it delays that ``F``/``B`` if it runs past the input's arrival. :func:`refill_w` replays
each rank's ``F``/``B`` (and ``BW``) order under the costs and, before each one, runs pending ``W`` (oldest
first) while they end no later than ``slack`` of a ``W`` after the input arrives — plus any the memory limit
forces before an ``F`` — and the rest at the end. Before a ``B`` of stage 0, whose output nobody waits for, a
``W`` may start whenever the input has not arrived yet, once the rank has no ``F`` left. Because a ``W`` has no consumer, the decision can wait until
the input's arrival time is known: the ``W`` s are placed at the rank's free time retroactively, which changes
nothing another rank has seen. The F/B order, hence validity and the in-flight count, is the base schedule's.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence

from ..ir.actions import Action, ActionKind, OverlapAction, Schedule
from ..ir.replay import replay_in_order

__all__ = ["refill_w"]

_F, _B, _W, _BW = ActionKind.F, ActionKind.B, ActionKind.W, ActionKind.BW


def refill_w(
    schedule: Schedule,
    f: Sequence[float],
    b: Sequence[float],
    w: Sequence[float],
    comm: float,
    *,
    limits: Sequence[float],
    w_memory: float = 1.0,
    slack: float = 0.0,
    tail_only: bool = False,
) -> Schedule:
    """``schedule`` with its ``W`` actions re-placed for the costs (see the module docstring).

    Args:
        schedule: a valid schedule of plain ``F``/``B``/``W``/``BW`` actions (no sync points or pairs).
        f, b, w: per-stage costs, one value per stage.
        comm: transfer latency between ranks.
        limits: per-rank memory limit in stage activations ``M_B``.
        w_memory: ``M_W / M_B``.
        slack: how far (in units of that ``W``'s cost) a filling ``W`` may run past the next input's
            arrival; 0 fills only gaps it fits in, ``math.inf`` runs every pending ``W`` as early as possible.
        tail_only: keep every ``W`` a rank runs before its last ``F`` where it is and re-place only those
            after it (the cool-down, where input gradients should go first and ``W`` fill the waits).

    Returns:
        A schedule with the same ``F``/``B`` order per rank and every ``W`` after its ``B``.

    Raises:
        ValueError: the schedule holds sync points or overlapped pairs.
    """
    m, n = schedule.n_microbatches, schedule.n_stages
    s2r = schedule.stage_to_rank
    orders = []
    for r, acts in enumerate(schedule.rank_actions):
        if any(type(a) is OverlapAction or a.kind not in (_F, _B, _W, _BW) for a in acts):
            raise ValueError(f"refill_w: rank {r} of {schedule.name!r} holds sync points or overlapped pairs")
        last_f = max((j for j, a in enumerate(acts) if a.kind is _F), default=-1) if tail_only else -1
        orders.append([a for j, a in enumerate(acts) if a.kind is not _W or j < last_f])
    last_f = [max((j for j, a in enumerate(order) if a.kind is _F), default=-1) for order in orders]
    fixed_w = [{(a.stage, a.microbatch) for a in order if a.kind is _W} for order in orders]
    fend = [[math.nan] * m for _ in range(n)]
    bend = [[math.nan] * m for _ in range(n)]
    n_ranks = len(orders)
    free = [0.0] * n_ranks
    live = [0.0] * n_ranks
    pending: list[deque[Action]] = [deque() for _ in range(n_ranks)]
    out: list[list[Action]] = [[] for _ in range(n_ranks)]

    def lat(src: int, dst: int) -> float:
        return 0.0 if s2r[src] == s2r[dst] else comm

    def ready(a: Action) -> float:
        """Arrival of ``a``'s inputs (NaN while a producer is unscheduled)."""
        s, i = a.stage, a.microbatch
        if a.kind is _F:
            return 0.0 if s == 0 else fend[s - 1][i] + lat(s - 1, s)
        t = fend[s][i]
        return t if s == n - 1 else max(t, bend[s + 1][i] + lat(s + 1, s))

    def run_w(r: int) -> None:
        a = pending[r].popleft()
        out[r].append(a)
        free[r] += w[a.stage]
        live[r] -= w_memory

    def try_run(r: int, j: int) -> bool:
        a = orders[r][j]
        if a.kind is _W:  # kept in place (tail_only): its B ran earlier on this rank
            out[r].append(a)
            free[r] += w[a.stage]
            live[r] -= w_memory
            return True
        t_in = ready(a)
        if t_in != t_in:  # NaN: wait for the producer
            return False
        if a.kind is _F:  # memory the limit forces free first
            while pending[r] and live[r] + 1.0 > limits[r] + 1e-9:
                run_w(r)
        # After the rank's last F, stage 0's input gradient feeds nobody: delaying it costs only this
        # rank's own time, so a W may start whenever that input has not arrived yet.
        give = max(slack, 1.0) if a.stage == 0 and j > last_f[r] else slack
        while pending[r] and (
            give == math.inf or free[r] + w[pending[r][0].stage] * (1.0 - give) <= t_in + 1e-12
        ):
            run_w(r)
        start = max(free[r], t_in)
        s, i = a.stage, a.microbatch
        if a.kind is _F:
            cost = f[s]
            live[r] += 1.0
        elif a.kind is _B:
            cost = b[s]
            live[r] -= 1.0 - w_memory
            if (s, i) not in fixed_w[r]:
                pending[r].append(Action(s, _W, i))
        else:
            cost = b[s] + w[s]
            live[r] -= 1.0
        free[r] = start + cost
        (fend if a.kind is _F else bend)[s][i] = free[r]
        out[r].append(a)
        return True

    pos = replay_in_order(orders, try_run)
    if any(pos[r] < len(orders[r]) for r in range(n_ranks)):  # pragma: no cover - the base order is valid
        raise RuntimeError(f"refill_w: {schedule.name!r} did not replay; is it a valid schedule?")
    for r in range(n_ranks):
        while pending[r]:
            run_w(r)
    return Schedule(schedule.name, m, s2r, tuple(map(tuple, out)))
