"""Shared pieces of the schedule builders: argument checks, a per-rank program writer, stage mappings."""

from __future__ import annotations

from collections import deque

from ..ir.actions import Action, ActionKind, OverlapAction, Schedule

# Actions are built in bulk (p = 64, m = 512 writes ~200k); tuple.__new__ skips NamedTuple's Python-level __new__.
_new = tuple.__new__
_F, _B, _W, _BW = ActionKind.F, ActionKind.B, ActionKind.W, ActionKind.BW

__all__ = [
    "RankProgram",
    "check_choice",
    "check_positive_int",
    "check_v_shape",
    "finish",
    "loop_mapping",
    "v_mapping",
]


def check_positive_int(schedule: str, **values: object) -> None:
    """Raise ``ValueError`` naming ``schedule`` unless every keyword value is an ``int >= 1``."""
    for key, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{schedule}: {key} must be an integer >= 1, got {key}={value!r}")


def check_v_shape(schedule: str, n_stages: int, n_microbatches: int) -> None:
    """``ValueError`` naming ``schedule`` unless both counts are integers >= 1 and ``n_stages`` is even (the V
    placements hold two stages per rank)."""
    check_positive_int(schedule, n_stages=n_stages, n_microbatches=n_microbatches)
    if n_stages % 2:
        raise ValueError(
            f"{schedule} places two stages per rank in a V, so n_stages must be even, got {n_stages=}"
        )


def check_choice(schedule: str, name: str, value: object, allowed: tuple[str, ...]) -> None:
    """``ValueError`` naming ``schedule`` and the option ``name`` unless ``value`` is one of ``allowed``."""
    if value not in allowed:
        options = ", ".join(map(repr, allowed[:-1])) + f" or {allowed[-1]!r}"
        raise ValueError(f"{schedule}: {name} must be {options}, got {name}={value!r}")


def loop_mapping(n_stages: int, n_ranks: int) -> tuple[int, ...]:
    """Stage ``s`` on rank ``s % n_ranks`` (1F1B, interleaved: rank ``r`` holds ``r, r + p, r + 2p, ...``)."""
    return tuple(s % n_ranks for s in range(n_stages))


def v_mapping(n_ranks: int) -> tuple[int, ...]:
    """Two stages per rank in a V: rank ``r`` holds stages ``r`` and ``2 * n_ranks - 1 - r``."""
    return tuple(range(n_ranks)) + tuple(range(n_ranks - 1, -1, -1))


class RankProgram:
    """Writes one rank's action list, handing out microbatch indices in order per (stage, kind).

    ``forward(s)`` runs the next microbatch's ``F`` of stage ``s``; ``backward(s)`` its next ``B`` (the matching
    ``W`` is queued); ``full_backward(s)`` its next ``BW``; ``weight()`` runs the oldest queued ``W``.
    """

    __slots__ = ("_nb", "_nf", "actions", "pending")

    def __init__(self) -> None:
        self.actions: list[Action] = []
        self.pending: deque[Action] = deque()
        self._nf: dict[int, int] = {}
        self._nb: dict[int, int] = {}  # B and BW share the counter: both produce the input gradient

    def count(self, stage: int, kind: ActionKind) -> int:
        """How many ``kind`` actions of ``stage`` were written (``B`` counts ``BW`` too)."""
        if kind is ActionKind.F:
            return self._nf.get(stage, 0)
        if kind is ActionKind.W:
            return self._nb.get(stage, 0) - sum(1 for a in self.pending if a.stage == stage)
        return self._nb.get(stage, 0)

    def forward(self, stage: int) -> None:
        mb = self._nf.get(stage, 0)
        self._nf[stage] = mb + 1
        self.actions.append(_new(Action, (stage, _F, mb)))

    def backward(self, stage: int) -> None:
        mb = self._nb.get(stage, 0)
        self._nb[stage] = mb + 1
        self.actions.append(_new(Action, (stage, _B, mb)))
        self.pending.append(_new(Action, (stage, _W, mb)))

    def full_backward(self, stage: int) -> None:
        mb = self._nb.get(stage, 0)
        self._nb[stage] = mb + 1
        self.actions.append(_new(Action, (stage, _BW, mb)))

    def weight(self, stage: int | None = None) -> bool:
        """Run the oldest pending ``W`` (of ``stage`` if given); returns whether there was one."""
        pending = self.pending
        if pending and (stage is None or pending[0].stage == stage):
            self.actions.append(pending.popleft())
            return True
        for j, action in enumerate(pending):
            if action.stage == stage:
                del pending[j]
                self.actions.append(action)
                return True
        return False

    def overlap_last_two(self) -> None:
        """Fuse the last two actions written (an ``F`` then a ``B``/``BW``) into one overlapped action."""
        backward = self.actions.pop()
        forward = self.actions.pop()
        self.actions.append(OverlapAction(forward, backward))

    def drain(self) -> None:
        """Run every pending ``W``, oldest first."""
        self.actions.extend(self.pending)
        self.pending.clear()


def finish(
    name: str,
    n_microbatches: int,
    stage_to_rank: tuple[int, ...],
    programs: list[RankProgram],
) -> Schedule:
    """Assemble a :class:`Schedule`, dropping *phantom* microbatches (indices ``>= n_microbatches``).

    Some builders write their steady-state pattern for at least as many microbatches as the pipeline needs to
    fill and then drop the surplus. Removing every action of a microbatch keeps a schedule complete and
    deadlock-free: no other microbatch's action depends on it.
    """
    return Schedule(
        name=name,
        n_microbatches=n_microbatches,
        stage_to_rank=stage_to_rank,
        rank_actions=tuple(tuple(_drop_phantoms(prog.actions, n_microbatches)) for prog in programs),
    )


def _drop_phantoms(actions: list, n_microbatches: int) -> list:
    """``actions`` without parts of microbatches ``>= n_microbatches`` (a pair that loses one part is unfused)."""
    out = []
    for a in actions:
        if type(a) is OverlapAction:
            kept = [p for p in a.parts if p.microbatch < n_microbatches]
            out.append(a if len(kept) == 2 else kept[0]) if kept else None
        elif a.microbatch < n_microbatches:
            out.append(a)
    return out
