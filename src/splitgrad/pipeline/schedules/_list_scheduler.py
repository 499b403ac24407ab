"""The greedy list scheduler zb-auto and zbv-auto share: one event loop, a pure choice per planner.

Both planners follow the zero-bubble paper's heuristic (Qi et al., ICLR 2024, section 3.1): whenever a rank is
free, it picks its next action from what it could run *now*. What differs is only that pick, so each planner
is a pure ``choose(state, rank, t)`` (:class:`Planner`), reading the pass's state and returning :class:`Run` or
:class:`Wait`; everything else is here, once: running the action (it ends one cost later; an ``F`` holds one
activation ``M_B``, a ``B`` frees all but ``M_W = w_memory * M_B`` and queues its ``W``, the ``W`` frees the
rest: the paper's memory model, Table 1), the queue of ranks to look at next, and the end of the pass.
Stage-indexed state (end times, counts) and rank-indexed state (memory, free time, queue, program) are kept
apart so one stage per rank (zb-auto) and two per rank (zbv-auto) share it.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from dataclasses import dataclass
from typing import ClassVar, NamedTuple, Protocol

from ..ir._coerce import as_cost
from ..ir.actions import Action, ActionKind, Schedule
from ..ir.simulate import Costs, SimulationResult, check_w_memory, simulate, stage_costs

__all__ = ["PassState", "PlanCosts", "Planner", "Run", "Wait", "list_schedule"]

_F, _B = ActionKind.F, ActionKind.B


@dataclass(frozen=True, slots=True)
class PlanCosts:
    """What a cost-aware search plans with: per-stage costs, the transfer latency and the memory model.

    One per search: every greedy pass and every candidate's simulation read the same numbers.
    """

    f: tuple[float, ...]
    """Forward cost per stage."""
    b: tuple[float, ...]
    """Input-gradient cost per stage."""
    w: tuple[float, ...]
    """Weight-gradient cost per stage."""
    comm: float
    """Latency of a transfer between two ranks."""
    w_memory: float
    """``M_W / M_B``: the fraction of an activation a ``B`` keeps for its ``W``."""

    @classmethod
    def of(
        cls, who: str, n_stages: int, *, f: Costs, b: Costs, w: Costs, comm: float, w_memory: float
    ) -> PlanCosts:
        """The costs of ``n_stages`` stages, checked.

        Raises:
            ValueError: a cost list of the wrong length, a negative, non-finite or non-real cost, or ``w_memory``
                outside ``[0, 1]`` (naming ``who`` and the argument).
        """
        return cls(
            stage_costs(f, n_stages, "f"),
            stage_costs(b, n_stages, "b"),
            stage_costs(w, n_stages, "w"),
            as_cost("comm", comm),
            check_w_memory(w_memory, who),
        )

    def simulate(self, schedule: Schedule) -> SimulationResult:
        """``schedule`` simulated under these costs (:func:`~splitgrad.pipeline.simulate`)."""
        return simulate(schedule, self.f, self.b, self.w, self.comm, w_memory=self.w_memory)


class PassState:
    """End times and counts per stage, memory and programs per rank, of one greedy pass.

    Args:
        n_stages: model stages.
        n_ranks: ranks (each holds ``n_stages / n_ranks`` stages).
        n_microbatches: microbatches.
        costs: per-stage ``f``/``b``/``w`` and ``w_memory`` (``comm`` is the planner's business).

    Attributes:
        fend, bend: ``[stage][microbatch]`` end time of that ``F`` / ``B``; ``inf`` until scheduled.
        nf, nb: per stage, how many ``F`` / ``B`` ran (the next one's microbatch).
        live: per rank, activation memory held, in ``M_B``.
        free: per rank, when its last action ends.
        last_was_f: per rank, whether its last ``F``/``B`` was an ``F``.
        pending: per rank, ``(stage, microbatch)`` of each ``W`` owed, oldest first.
        actions: per rank, the program so far.
        per_rank: actions each rank runs in a complete pass (``3 m`` per stage it holds).
    """

    __slots__ = (
        "_b", "_f", "_r_w", "_w", "actions", "bend", "fend", "free", "last_was_f", "live", "n_ranks", "nb", "nf",
        "pending", "per_rank",
    )  # fmt: skip

    def __init__(self, n_stages: int, n_ranks: int, n_microbatches: int, costs: PlanCosts) -> None:
        self._f, self._b, self._w, self._r_w = costs.f, costs.b, costs.w, costs.w_memory
        self.n_ranks = n_ranks
        self.per_rank = 3 * n_microbatches * (n_stages // n_ranks)
        self.fend = [[math.inf] * n_microbatches for _ in range(n_stages)]
        self.bend = [[math.inf] * n_microbatches for _ in range(n_stages)]
        self.nf, self.nb = [0] * n_stages, [0] * n_stages
        self.live = [0.0] * n_ranks
        self.free = [0.0] * n_ranks
        self.last_was_f = [False] * n_ranks
        self.pending: list[deque[tuple[int, int]]] = [deque() for _ in range(n_ranks)]
        self.actions: list[list[Action]] = [[] for _ in range(n_ranks)]

    def run(self, r: int, kind: ActionKind, s: int, t: float) -> tuple[int, float]:
        """Run on rank ``r`` at time ``t`` the next ``kind`` of stage ``s`` (a ``W``: the oldest pending, ``s``
        ignored); returns its ``(stage, end time)``."""
        if kind is _F:
            i = self.nf[s]
            end = t + self._f[s]
            self.fend[s][i] = end
            self.nf[s] = i + 1
            self.live[r] += 1.0
            self.last_was_f[r] = True
        elif kind is _B:
            i = self.nb[s]
            end = t + self._b[s]
            self.bend[s][i] = end
            self.nb[s] = i + 1
            self.live[r] -= 1.0 - self._r_w
            self.pending[r].append((s, i))
            self.last_was_f[r] = False
        else:
            s, i = self.pending[r].popleft()
            end = t + self._w[s]
            self.live[r] -= self._r_w
        self.actions[r].append(Action(s, kind, i))
        self.free[r] = end
        return s, end


class Run(NamedTuple):
    """Run the next ``kind`` of ``stage`` now (a ``W``: the rank's oldest pending one; ``stage`` unused)."""

    kind: ActionKind
    stage: int


class Wait(NamedTuple):
    """Nothing to run now: look at the rank again at ``until`` (None: no time known yet) and, with
    ``on_producer``, when a producer of its input runs (:attr:`Planner.wake_idle_only`)."""

    until: float | None
    on_producer: bool


class Planner(Protocol):
    """What a free rank runs next (:meth:`choose`), and whom a finished action lets run (:meth:`consumer`).

    Both are pure: they read the pass's state and change nothing. Two class constants are the planner's
    queue rules, each the rule its planner was tuned with; the loop is the same. The rules matter: zb-auto
    under zbv-auto's rules gives another plan in 45 of the 5,388 settings checked when they were unified.
    """

    fifo_ties: ClassVar[bool]
    """Ranks due at the same time are looked at in the order they were queued (else: lowest rank first)."""
    wake_idle_only: ClassVar[bool]
    """A producer wakes its consumer only while the consumer waits on a producer, at the time the planner
    says, replacing the consumer's queued look (else: always, when that is earlier than its queued look)."""

    def choose(self, state: PassState, r: int, t: float) -> Run | Wait:
        """What rank ``r``, free at ``t``, does now."""
        ...

    def consumer(
        self, state: PassState, kind: ActionKind, stage: int, start: float, end: float
    ) -> tuple[int, float] | None:
        """The rank the ``kind`` action of ``stage`` (run over ``[start, end)``) produced an input for, and
        when to look at it; None: nobody."""
        ...


def list_schedule(planner: Planner, state: PassState) -> bool:
    """Run the greedy pass: look at each free rank in time order, and do what ``planner`` chooses.

    Args:
        planner: the choice (and the two queue rules) of zb-auto or zbv-auto.
        state: a fresh pass state; holds the programs afterwards.

    Returns:
        Whether every rank ran all its actions (False: the pass stalled, e.g. memory full on every rank that
        could unblock another).
    """
    fifo, idle_only = planner.fifo_ties, planner.wake_idle_only
    choose, consumer, run = planner.choose, planner.consumer, state.run
    n, free, actions, per_rank = state.n_ranks, state.free, state.actions, state.per_rank
    due = [math.inf] * n  # when each rank's queued look is (inf: none queued)
    token = [0] * n  # the queued look that counts; an older entry still in the heap is stale
    waiting = [False] * n  # waits on a producer (Wait.on_producer)
    heap: list[tuple[float, int, int, int]] = []
    seq = itertools.count()

    def look(r: int, t: float, replace: bool) -> None:
        if replace or t < due[r]:
            token[r] += 1
            due[r], waiting[r] = t, False
            heapq.heappush(heap, (t, next(seq) if fifo else r, r, token[r]))

    for r in range(n):
        look(r, 0.0, True)
    while heap:
        now, _, r, tok = heapq.heappop(heap)
        if tok != token[r]:
            continue
        due[r] = math.inf
        t = max(now, free[r])
        choice = choose(state, r, t)
        if type(choice) is Wait:
            if choice.until is not None:
                look(r, choice.until, True)
            waiting[r] = choice.on_producer
            continue
        kind = choice.kind
        s, end = run(r, kind, choice.stage, t)
        if len(actions[r]) < per_rank:
            look(r, end, True)
        woken = consumer(state, kind, s, t, end)
        if woken is not None and (waiting[woken[0]] or not idle_only):
            look(woken[0], woken[1], idle_only)
    return all(len(acts) == per_rank for acts in actions)
