"""V schedules built from a building block on a unit-slot grid (Qi, Wan, Amar, Lin, "Pipeline Parallelism with
Controllable Memory", NeurIPS 2024): the machinery ``v-half`` and ``v-min`` share.

The paper's recipe. A *building block* says when each of a rank's four passes of microbatch 0 runs, in unit
slots (``F = B = W = 1``): the forward of its down stage, the forward of its up stage, the input gradient of the
up stage, the input gradient of the down stage. Microbatch ``j`` repeats the block ``6 j`` slots later (two
stages' ``F``, ``B`` and ``W``), so a rank's two free slots per period take the weight gradients. The block's
offsets fix every microbatch's lifespan, hence the activation memory (V-Min about a third of 1F1B's, V-Half
about half); repeating it gives a schedule with a raw warm-up and cool-down, which two *squeeze* passes
tighten without exceeding the block's peak:

1. Weight gradients go into the free slots (oldest ``B`` first). Every op of the warm-up (before rank 0's
   first down-stage ``B``) and of the cool-down (after rank 0's last down-stage ``F``) moves to the earliest
   free slot after its inputs whose move keeps the rank within the memory budget; the steady state stays as
   the block made it. The slots are then compacted: every op as early as its inputs allow, each rank's order
   kept.
2. Without the weight gradients (a ``W`` fills any idle slot, so memory is counted that way), the cool-down
   is squeezed again, the ``W`` put back and the slots compacted.

Last, each rank's ``W`` are placed once more into its idle slots, the up stage's first (its microbatch is
younger: freeing it early keeps the lifespans short), and the per-rank order is read off the slots. The order
depends only on the block, never on the costs.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from itertools import accumulate

from ..ir.actions import Action, ActionKind, Schedule
from ..ir.replay import replay_in_order
from ._common import check_v_shape, v_mapping

__all__ = ["PERIOD", "block_schedule", "v_block_schedule"]

PERIOD = 6
"""Slots per microbatch per rank: ``F``, ``B`` and ``W`` of two stages."""

# A rank's op types: its down stage r ("chunk 0"), its up stage 2p - 1 - r ("chunk 1").
F_DOWN, F_UP, B_UP, B_DOWN, W_UP, W_DOWN = range(6)
_W_OF = {B_UP: W_UP, B_DOWN: W_DOWN}
_KIND = (ActionKind.F, ActionKind.F, ActionKind.B, ActionKind.B, ActionKind.W, ActionKind.W)
_DOWN = frozenset({F_DOWN, B_DOWN, W_DOWN})

Op = tuple[int, int]
"""``(op type, microbatch)``."""


class _Grid:
    """Slots of every op on every rank (``slot[r][op]``, ``at[r][slot]``) and the dependencies between them."""

    def __init__(self, p: int, m: int) -> None:
        self.p, self.m = p, m
        self.slot: list[dict[Op, int]] = [{} for _ in range(p)]
        self.at: list[dict[int, Op]] = [{} for _ in range(p)]

    def put(self, r: int, op: Op, slot: int) -> None:
        old = self.slot[r].get(op)
        if old is not None:
            del self.at[r][old]
        self.slot[r][op] = slot
        self.at[r][slot] = op

    def drop_w(self) -> None:
        for r in range(self.p):
            for op in [op for op in self.slot[r] if op[0] >= W_UP]:
                del self.at[r][self.slot[r].pop(op)]

    def inputs(self, r: int, op: Op) -> list[tuple[int, Op]]:
        """The ops ``(rank, op)`` whose output ``op`` consumes."""
        t, j = op
        p = self.p
        if t == F_DOWN:
            return [(r - 1, (F_DOWN, j))] if r > 0 else []
        if t == F_UP:  # the V turns on rank p - 1 without a transfer
            return [(r + 1, (F_UP, j))] if r < p - 1 else [(r, (F_DOWN, j))]
        if t == B_UP:  # rank 0 holds the last stage: its loss gradient needs its own forward
            return [(r - 1, (B_UP, j))] if r > 0 else [(r, (F_UP, j))]
        if t == B_DOWN:
            return [(r + 1, (B_DOWN, j))] if r < p - 1 else [(r, (B_UP, j))]
        return [(r, (B_UP if t == W_UP else B_DOWN, j))]

    def earliest(self, r: int, op: Op) -> int:
        """First slot ``op`` may take: after its inputs and after the same pass of the previous microbatch."""
        after = [self.slot[q][x] for q, x in self.inputs(r, op)]
        if op[1] > 0:
            after.append(self.slot[r][(op[0], op[1] - 1)])
        return max(after, default=-1) + 1

    def ordered(self, r: int) -> list[Op]:
        return [self.at[r][s] for s in sorted(self.at[r])]


def _deltas(grid: _Grid, r: int) -> list[int]:
    """Rank ``r``'s change of live activations per slot (``F`` +1, ``W`` -1, ``B`` and idle 0)."""
    out = [0] * (max(grid.at[r], default=-1) + 1)
    for s, op in grid.at[r].items():
        out[s] = _delta(op)
    return out


def _fits_earlier(deltas: list[int], slot: int, current: int, budget: int) -> bool:
    """Whether a forward moved from ``current`` to the free ``slot`` keeps the rank within ``budget``: it holds
    one activation more in every slot in between."""
    held = accumulate(deltas[slot:current], initial=sum(deltas[:slot]))
    return max(held) + 1 <= budget


def _implicit_peak(grid: _Grid, r: int, moved: Op | None = None, slot: int = 0) -> int:
    """Peak live activations on rank ``r`` when every idle slot runs one pending ``W`` (``moved`` at ``slot``)."""
    at = dict(grid.at[r])
    if moved is not None:
        del at[grid.slot[r][moved]]
        at[slot] = moved
    live = pending = peak = 0
    for s in range(max(at) + 1 if at else 0):
        op = at.get(s)
        if op is None:
            if pending:
                pending -= 1
                live -= 1
        elif op[0] <= F_UP:
            live += 1
            peak = max(peak, live)
        else:
            pending += 1
    return peak


def _place_w(grid: _Grid, *, up_first: bool) -> None:
    """Put each rank's ``W`` into its idle slots as its ``B`` finish: one merged queue in ``B`` order, or (with
    ``up_first``) a queue per stage with the up stage's served first. Left-overs go after the last slot."""
    for r in range(grid.p):
        queues: tuple[deque[Op], deque[Op]] = (deque(), deque())  # (up, down) or (merged, unused)
        last = max(grid.at[r]) if grid.at[r] else -1
        for s in range(last + 1):
            op = grid.at[r].get(s)
            if op is None:
                queue = next((q for q in queues if q), None)
                if queue is not None:
                    grid.put(r, queue.popleft(), s)
            elif op[0] in _W_OF:
                target = queues[1] if up_first and op[0] == B_DOWN else queues[0]
                target.append((_W_OF[op[0]], op[1]))
        for queue in queues:
            while queue:
                last += 1
                grid.put(r, queue.popleft(), last)


def _visit_order(grid: _Grid) -> list[tuple[int, Op, int]]:
    """Every op as ``(rank, op, phase)`` in slot order (then rank, then type). Phase 0: before rank 0's first
    down-stage ``B`` (the warm-up); 1: from it through rank 0's last down-stage ``F`` (the steady state); 2:
    after (the cool-down)."""
    ops = sorted((s, r, op[0], op) for r in range(grid.p) for op, s in grid.slot[r].items())
    first_b, last_f = (B_DOWN, 0), (F_DOWN, grid.m - 1)
    out, seen_b, seen_f = [], False, False
    for _s, r, _t, op in ops:
        if r == 0 and op == first_b:
            seen_b = True
        out.append((r, op, 2 if seen_f and seen_b else 1 if seen_b else 0))
        if r == 0 and op == last_f:
            seen_f = True
    return out


def _squeeze(grid: _Grid, phases: tuple[int, ...], budget: int, *, explicit_w: bool) -> None:
    """Move every op of ``phases`` to the earliest free slot after its inputs that keeps its rank's peak within
    ``budget`` (``W`` counted where they stand, or filling idle slots when ``explicit_w`` is False)."""
    deltas = [_deltas(grid, r) for r in range(grid.p)] if explicit_w else []
    for r, op, phase in _visit_order(grid):
        if phase not in phases:
            continue
        current = grid.slot[r][op]
        for slot in range(grid.earliest(r, op), current):
            if slot in grid.at[r]:
                continue
            if explicit_w:
                # Only a forward adds memory when it moves earlier (a W frees it sooner, a B holds none).
                fits = op[0] > F_UP or _fits_earlier(deltas[r], slot, current, budget)
            else:
                fits = _implicit_peak(grid, r, op, slot) <= budget
            if fits:
                if explicit_w:
                    deltas[r][slot], deltas[r][current] = deltas[r][current], 0
                grid.put(r, op, slot)
                break


def _compact(grid: _Grid) -> None:
    """Re-time every op as early as its inputs allow with unit costs and free transfers, keeping each rank's
    order (what the squeezed slots mean once the holes left behind close)."""
    p = grid.p
    orders = [grid.ordered(r) for r in range(p)]
    ends: dict[tuple[int, Op], int] = {}
    free = [0] * p

    def try_run(r: int, j: int) -> bool:
        op = orders[r][j]
        deps = [ends.get(x) for x in grid.inputs(r, op)]
        if None in deps:
            return False
        start = max([free[r], *deps])
        ends[(r, op)] = free[r] = start + 1
        return True

    nxt = replay_in_order(orders, try_run)
    if any(
        n < len(o) for n, o in zip(nxt, orders)
    ):  # pragma: no cover - the squeeze only moves ops later-safe
        raise RuntimeError("v-blocks: compaction deadlocked; the squeezed order is not dependency-safe")
    for r in range(p):
        grid.at[r].clear()
        grid.slot[r].clear()
        for op in orders[r]:
            grid.put(r, op, ends[(r, op)] - 1)


def block_schedule(
    name: str, p: int, m: int, offsets: Sequence[Sequence[int]], *, squeeze: bool = True
) -> Schedule:
    """The schedule a building block generates for ``p`` ranks and ``m`` microbatches (see the module doc).

    Args:
        name: the schedule's name.
        p: ranks (the model has ``2p`` stages in a V).
        m: microbatches.
        offsets: per rank, the slots of microbatch 0's down-stage ``F``, up-stage ``F``, up-stage ``B`` and
            down-stage ``B`` (pairwise different modulo :data:`PERIOD`, else two microbatches share a slot).
        squeeze: run the two squeeze passes (False: the repeated block as it is, for comparison).

    Returns:
        The schedule, on :func:`~._common.v_mapping`.
    """
    for r, block in enumerate(offsets):
        if len({o % PERIOD for o in block}) != 4:
            raise ValueError(
                f"{name}: rank {r}'s block {tuple(block)} puts two passes in one slot of a period"
            )
    grid = _Grid(p, m)
    for r, block in enumerate(offsets):
        for t, first in enumerate(block):
            for j in range(m):
                grid.put(r, (t, j), first + PERIOD * j)
    _place_w(grid, up_first=False)
    budget = max(max(accumulate(_delta(op) for op in grid.ordered(r))) for r in range(p))
    if not squeeze:
        return _schedule(name, p, m, grid)
    # Pass 1: warm-up and cool-down, weight gradients where they stand.
    _squeeze(grid, (0, 2), budget, explicit_w=True)
    _compact(grid)
    # Pass 2: the cool-down again, weight gradients filling idle slots.
    grid.drop_w()
    _squeeze(grid, (2,), budget, explicit_w=False)
    _place_w(grid, up_first=False)
    _compact(grid)
    grid.drop_w()
    _place_w(grid, up_first=True)
    return _schedule(name, p, m, grid)


def v_block_schedule(
    name: str, n_stages: int, n_microbatches: int, block: Callable[[int], Sequence[Sequence[int]]]
) -> Schedule:
    """A building-block V schedule from its public arguments: :func:`block_schedule` of ``block(p)`` on
    ``p = n_stages / 2`` ranks.

    Args:
        name: the schedule's name (also in the messages).
        n_stages: stages, two per rank.
        n_microbatches: microbatches.
        block: ``block(p)`` gives the per-rank offsets of :func:`block_schedule`.

    Raises:
        ValueError: ``n_stages`` is not even, or a count is not an integer >= 1.
    """
    check_v_shape(name, n_stages, n_microbatches)
    p = n_stages // 2
    return block_schedule(name, p, n_microbatches, block(p))


def _schedule(name: str, p: int, m: int, grid: _Grid) -> Schedule:
    lists = tuple(tuple(_action(p, r, op) for op in grid.ordered(r)) for r in range(p))
    return Schedule(name=name, n_microbatches=m, stage_to_rank=v_mapping(p), rank_actions=lists)


def _delta(op: Op) -> int:
    return 1 if op[0] <= F_UP else -1 if op[0] >= W_UP else 0


def _action(p: int, r: int, op: Op) -> Action:
    t, j = op
    stage = r if t in _DOWN else 2 * p - 1 - r
    return Action(stage, _KIND[t], j)
