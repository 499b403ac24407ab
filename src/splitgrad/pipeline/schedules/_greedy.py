"""The state of one greedy list-scheduling pass, shared by zb-auto and zbv-auto.

Each planner decides *what* a free rank runs next; running it is the same in both: the action ends one cost
later, an ``F`` holds one activation ``M_B``, a ``B`` frees all but ``M_W = w_memory * M_B`` and queues its
``W``, the ``W`` frees the rest (the paper's memory model, Table 1). Stage-indexed state (end times,
counts) and rank-indexed state (memory, free time, queue, program) are kept apart so one stage per rank
(zb-auto) and two per rank (zbv-auto) share it.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence

from ..ir.actions import Action, ActionKind

__all__ = ["PassState"]

_F, _B = ActionKind.F, ActionKind.B


class PassState:
    """End times and counts per stage, memory and programs per rank, of one greedy pass.

    Args:
        n_stages: model stages.
        n_ranks: ranks.
        n_microbatches: microbatches.
        f, b, w: per-stage costs, one value per stage.
        w_memory: ``M_W / M_B``, what a ``B`` keeps for its ``W``.

    Attributes:
        fend, bend: ``[stage][microbatch]`` end time of that ``F`` / ``B``; ``inf`` until scheduled.
        nf, nb: per stage, how many ``F`` / ``B`` ran (the next one's microbatch).
        live: per rank, activation memory held, in ``M_B``.
        free: per rank, when its last action ends.
        last_was_f: per rank, whether its last ``F``/``B`` was an ``F``.
        pending: per rank, ``(stage, microbatch)`` of each ``W`` owed, oldest first.
        actions: per rank, the program so far.
    """

    __slots__ = (
        "_b", "_f", "_r_w", "_w", "actions", "bend", "fend", "free", "last_was_f", "live", "nb", "nf",
        "pending",
    )  # fmt: skip

    def __init__(
        self,
        n_stages: int,
        n_ranks: int,
        n_microbatches: int,
        f: Sequence[float],
        b: Sequence[float],
        w: Sequence[float],
        w_memory: float,
    ) -> None:
        self._f, self._b, self._w, self._r_w = f, b, w, w_memory
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
