"""Pipeline schedules as data: actions, per-rank action lists, and the stage-to-rank mapping.

An :class:`Action` is ``(stage, kind, microbatch)``. Compute kinds are ``F`` (forward), ``B`` (input gradient
only), ``W`` (weight gradient, the work ``backward_dw()`` runs) and ``BW`` (full backward, for schedules that do
not split). Its string form is compact and round-trips: ``"1F0"``, ``"2W3"``, ``"0BW5"``; the same string names
the profiler range a runtime opens for it.

Two more kinds make what a runtime does around the compute part of the schedule (torch.pipelining's
``REDUCE_GRAD``): gradient-sync points ``R`` ("the stage's data-parallel reductions may start from here") and
``RF`` ("finish the stage's reductions"), without a microbatch (``"0R"``, ``"0RF"``); see
:func:`splitgrad.pipeline.passes.add_grad_sync`. An :class:`OverlapAction` (torch's ``OVERLAP_F_B``, DualPipe's
``overlapped_forward_backward``) holds an ``F`` and a ``B``/``BW`` of other microbatches on the same rank that run
as one unit: ``"0F3+3BW1"``.

A :class:`Schedule` is one ordered action list per rank plus the stage-to-rank mapping. It only *describes*
work; :func:`splitgrad.pipeline.validate` checks it, :func:`splitgrad.pipeline.simulate` times it, and a runtime
interprets it, using :meth:`Schedule.recv_before` / :meth:`Schedule.send_after` to know which point-to-point
messages surround an action.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum
from typing import NamedTuple

__all__ = [
    "COMPUTE_KINDS",
    "SYNC_KINDS",
    "Action",
    "ActionKind",
    "AnyAction",
    "OverlapAction",
    "Schedule",
    "ScheduleError",
    "Transfer",
    "parse_action",
]


class ScheduleError(ValueError):
    """A schedule is malformed, incomplete, out of dependency order, or would deadlock."""


class ActionKind(str, Enum):
    """What an action computes for one (stage, microbatch)."""

    F = "F"
    """Forward."""
    B = "B"
    """Input gradient only (dgrad); the weight gradient is left pending for a later ``W``."""
    W = "W"
    """Weight gradient of an earlier ``B`` (``backward_dw()``)."""
    BW = "BW"
    """Full backward: input and weight gradient together."""
    R = "R"
    """Gradient-sync point: the stage's data-parallel reductions may start from here on (no microbatch)."""
    RF = "RF"
    """Gradient-sync point: finish the stage's data-parallel reductions (no microbatch)."""
    FB = "FB"
    """An :class:`OverlapAction`: a forward and a backward of two microbatches run as one unit."""

    # Enum.__hash__ is a Python-level call; hashing like the plain string keeps dict lookups in the
    # simulator cheap and stays consistent with ``ActionKind.F == "F"``.
    __hash__ = str.__hash__

    def __str__(self) -> str:
        return self.value


COMPUTE_KINDS = frozenset({ActionKind.F, ActionKind.B, ActionKind.W, ActionKind.BW})
"""Kinds that compute for one (stage, microbatch)."""
SYNC_KINDS = frozenset({ActionKind.R, ActionKind.RF})
"""Gradient-sync kinds: per stage, no microbatch (``Action.microbatch`` is None)."""

_ACTION_RE = re.compile(r"^(\d+)(BW|F|B|W)(\d+)$")
_SYNC_RE = re.compile(r"^(\d+)(RF|R)$")
_KINDS_BY_VALUE = {kind.value: kind for kind in ActionKind}


class Action(NamedTuple):
    """One unit of pipeline work: ``kind`` for ``microbatch`` on model ``stage``.

    ``str(action)`` (also ``action.name``) is the compact form ``f"{stage}{kind}{microbatch}"``; parse it back
    with :func:`parse_action` or :meth:`Action.parse`.
    """

    stage: int
    kind: ActionKind
    microbatch: int | None
    """The microbatch; None for the gradient-sync kinds ``R`` and ``RF``."""

    @property
    def name(self) -> str:
        """Compact string form, e.g. ``"1F0"`` or ``"0RF"``; also the profiler range name."""
        if self.microbatch is None:
            return f"{self.stage}{self.kind.value}"
        return f"{self.stage}{self.kind.value}{self.microbatch}"

    @property
    def parts(self) -> tuple[Action]:
        """The compute actions this action consists of (itself); see :attr:`OverlapAction.parts`."""
        return (self,)

    def __str__(self) -> str:
        return self.name

    @classmethod
    def parse(cls, text: str) -> AnyAction:
        """Inverse of ``str(action)``; see :func:`parse_action`."""
        return parse_action(text)


class OverlapAction(NamedTuple):
    """A forward and a backward (``B`` or ``BW``) of other microbatches, run on one rank as one unit.

    torch.pipelining's ``OVERLAP_F_B``, DualPipe's ``overlapped_forward_backward``: the two parts' work can hide
    each other's communication (e.g. an MoE all-to-all). The unit starts when both parts' inputs exist and
    both outputs exist at its end. String form ``"<forward>+<backward>"``, e.g. ``"0F3+3BW1"``.
    """

    forward: Action
    """The ``F`` part."""
    backward: Action
    """The ``B`` or ``BW`` part (any stage of the same rank, any other microbatch)."""

    @property
    def kind(self) -> ActionKind:
        """Always :attr:`ActionKind.FB`."""
        return ActionKind.FB

    @property
    def stage(self) -> int:
        """The forward part's stage."""
        return self.forward.stage

    @property
    def microbatch(self) -> None:
        """None: the parts carry the microbatches."""
        return None

    @property
    def parts(self) -> tuple[Action, Action]:
        """``(forward, backward)``."""
        return (self.forward, self.backward)

    @property
    def name(self) -> str:
        """Compact string form, e.g. ``"0F3+3BW1"``; also the profiler range name."""
        return f"{self.forward.name}+{self.backward.name}"

    def __str__(self) -> str:
        return self.name


AnyAction = Action | OverlapAction
"""What a rank's action list holds."""


def parse_action(text: str) -> AnyAction:
    """Parse the compact form: ``"<stage><kind><microbatch>"`` (``"2W3"``, ``"0BW1"``), a sync point
    ``"<stage>R"`` / ``"<stage>RF"``, or an overlapped pair ``"<F action>+<B or BW action>"`` (``"0F3+3BW1"``).

    Raises:
        ValueError: ``text`` is not of that form.
    """
    body = text.strip()
    if "+" in body:
        head, _, tail = body.partition("+")
        forward, backward = parse_action(head), parse_action(tail)
        if forward.kind is not ActionKind.F or backward.kind not in (ActionKind.B, ActionKind.BW):
            raise ValueError(
                f"cannot parse action {text!r}: an overlapped pair is '<F action>+<B or BW action>' (e.g. "
                f"'0F3+3BW1'), got {forward.kind.value} + {backward.kind.value}"
            )
        return OverlapAction(forward, backward)
    match = _ACTION_RE.match(body)
    if match is not None:
        stage, kind, microbatch = match.groups()
        return Action(int(stage), _KINDS_BY_VALUE[kind], int(microbatch))
    match = _SYNC_RE.match(body)
    if match is not None:
        stage, kind = match.groups()
        return Action(int(stage), _KINDS_BY_VALUE[kind], None)
    raise ValueError(
        f"cannot parse action {text!r}: expected '<stage><kind><microbatch>' with kind in F, B, W, BW "
        "(e.g. '1F0', '2W3', '0BW1'), a sync point '<stage>R' / '<stage>RF', or '<F action>+<B action>'"
    )


class Transfer(NamedTuple):
    """A point-to-point message between the ranks of two adjacent stages.

    ``kind`` is ``"activation"`` (output of ``src_stage``'s forward, input of ``dst_stage = src_stage + 1``) or
    ``"gradient"`` (input gradient from ``src_stage``'s backward, for ``dst_stage = src_stage - 1``).
    """

    kind: str
    src_stage: int
    dst_stage: int
    microbatch: int
    src_rank: int
    dst_rank: int


@dataclass(frozen=True, slots=True)
class Schedule:
    """Per-rank ordered action lists plus the stage-to-rank mapping.

    Construction checks the shape only (ranks, stage ownership, index ranges); whether every action appears
    exactly once, in dependency order and without deadlock is :func:`splitgrad.pipeline.validate`'s job.
    """

    name: str
    """Schedule family, e.g. ``"zb-h1"``; free text without newlines."""
    n_microbatches: int
    """Microbatches per step; actions use indices ``0 .. n_microbatches - 1``."""
    stage_to_rank: tuple[int, ...]
    """``stage_to_rank[s]`` is the rank that runs model stage ``s``; every rank holds at least one stage."""
    rank_actions: tuple[tuple[AnyAction, ...], ...]
    """``rank_actions[r]`` is rank ``r``'s actions in execution order."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "stage_to_rank", tuple(int(r) for r in self.stage_to_rank))
        object.__setattr__(self, "rank_actions", tuple(tuple(acts) for acts in self.rank_actions))
        if "\n" in self.name:
            raise ValueError(f"Schedule name must be a single line, got {self.name!r}")
        if self.n_microbatches < 1:
            raise ValueError(f"Schedule needs n_microbatches >= 1, got {self.n_microbatches=}")
        n_ranks = len(self.rank_actions)
        if not self.stage_to_rank or n_ranks == 0:
            raise ValueError(f"Schedule needs at least one stage and one rank, got {self.stage_to_rank=}")
        bad = [r for r in self.stage_to_rank if not 0 <= r < n_ranks]
        if bad:
            raise ValueError(f"stage_to_rank names ranks {bad} outside 0..{n_ranks - 1} ({n_ranks=})")
        empty = sorted(set(range(n_ranks)) - set(self.stage_to_rank))
        if empty:
            raise ValueError(f"ranks {empty} hold no stage in {self.stage_to_rank=}")

    # -- shape -----------------------------------------------------------------------------------------

    @property
    def n_stages(self) -> int:
        """Total number of model stages."""
        return len(self.stage_to_rank)

    @property
    def n_ranks(self) -> int:
        """Number of ranks (pipeline-parallel group size)."""
        return len(self.rank_actions)

    @property
    def n_actions(self) -> int:
        """Total number of actions over all ranks."""
        return sum(len(acts) for acts in self.rank_actions)

    def rank_of(self, stage: int) -> int:
        """Rank that runs ``stage``."""
        if not 0 <= stage < self.n_stages:
            raise ValueError(f"stage {stage} out of range 0..{self.n_stages - 1}")
        return self.stage_to_rank[stage]

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """Stages held by ``rank``, ascending."""
        if not 0 <= rank < self.n_ranks:
            raise ValueError(f"rank {rank} out of range 0..{self.n_ranks - 1}")
        return tuple(s for s, r in enumerate(self.stage_to_rank) if r == rank)

    def neighbours(self, stage: int) -> tuple[int | None, int | None]:
        """``(rank of stage - 1, rank of stage + 1)``, ``None`` past either end of the model.

        A runtime receives activations from / sends gradients to the first, and sends activations to /
        receives gradients from the second; a neighbour on the same rank is a local hand-off.
        """
        self.rank_of(stage)
        prev_rank = self.stage_to_rank[stage - 1] if stage > 0 else None
        next_rank = self.stage_to_rank[stage + 1] if stage + 1 < self.n_stages else None
        return prev_rank, next_rank

    # -- communication a runtime must do around an action ---------------------------------------------

    def receives(self, action: AnyAction) -> tuple[Transfer, ...]:
        """Every message ``action`` must receive before it runs (both parts of an :class:`OverlapAction`)."""
        return tuple(t for part in action.parts if (t := self.recv_before(part)) is not None)

    def sends(self, action: AnyAction) -> tuple[Transfer, ...]:
        """Every message ``action`` produces for another rank (both parts of an :class:`OverlapAction`)."""
        return tuple(t for part in action.parts if (t := self.send_after(part)) is not None)

    def recv_before(self, action: Action) -> Transfer | None:
        """The message ``action`` must receive before it can run, or ``None`` (local input or none needed).

        ``F`` of stage ``s > 0`` receives ``s - 1``'s activation; ``B``/``BW`` of stage ``s < n_stages - 1``
        receives ``s + 1``'s input gradient; ``W`` never receives.
        """
        if type(action) is OverlapAction:
            raise ValueError(f"recv_before takes one compute action; use receives() for {action}")
        stage, kind, mb = action
        here = self.rank_of(stage)
        if kind is ActionKind.F and stage > 0:
            there = self.stage_to_rank[stage - 1]
            if there != here:
                return Transfer("activation", stage - 1, stage, mb, there, here)
        elif kind in (ActionKind.B, ActionKind.BW) and stage + 1 < self.n_stages:
            there = self.stage_to_rank[stage + 1]
            if there != here:
                return Transfer("gradient", stage + 1, stage, mb, there, here)
        return None

    def send_after(self, action: Action) -> Transfer | None:
        """The message ``action`` produces for another rank, or ``None`` (consumer is local or absent)."""
        if type(action) is OverlapAction:
            raise ValueError(f"send_after takes one compute action; use sends() for {action}")
        stage, kind, mb = action
        here = self.rank_of(stage)
        if kind is ActionKind.F and stage + 1 < self.n_stages:
            there = self.stage_to_rank[stage + 1]
            if there != here:
                return Transfer("activation", stage, stage + 1, mb, here, there)
        elif kind in (ActionKind.B, ActionKind.BW) and stage > 0:
            there = self.stage_to_rank[stage - 1]
            if there != here:
                return Transfer("gradient", stage, stage - 1, mb, here, there)
        return None

    # -- text form (golden files, debugging) -----------------------------------------------------------

    def to_text(self) -> str:
        """Line-oriented text form that :meth:`from_text` reads back exactly."""
        lines = [
            f"schedule {self.name}",
            f"stages {self.n_stages}",
            f"microbatches {self.n_microbatches}",
            "stage_to_rank " + " ".join(str(r) for r in self.stage_to_rank),
        ]
        lines += [f"rank {r}: " + " ".join(a.name for a in acts) for r, acts in enumerate(self.rank_actions)]
        return "\n".join(lines) + "\n"

    @classmethod
    def from_text(cls, text: str) -> Schedule:
        """Parse :meth:`to_text` output; lines starting with ``#`` and blank lines are ignored.

        Raises:
            ValueError: naming the line of an unknown field or a malformed rank line, or the missing fields.
        """
        from .text_form import parse_schedule_text

        name, n_microbatches, stage_to_rank, rank_lines = parse_schedule_text(text)
        ranks = tuple(tuple(parse_action(tok) for tok in line) for line in rank_lines)
        return cls(name=name, n_microbatches=n_microbatches, stage_to_rank=stage_to_rank, rank_actions=ranks)

    # -- PyTorch's schedule CSV (torch.distributed.pipelining, torchtitan) ---------------------------------

    @classmethod
    def from_csv(
        cls, text: str, *, n_microbatches: int | None = None, name: str = "csv", comms: str = "refuse"
    ) -> Schedule:
        """Read PyTorch's schedule CSV (:mod:`~splitgrad.pipeline.ir.torch_csv` gives the format).

        Args:
            text: the file's content: one row per rank, PyTorch's ``I`` is splitgrad's ``B``, its ``B`` our ``BW``.
            n_microbatches: microbatches per step (default: the largest index in the file, plus one).
            name: the schedule's name.
            comms: ``"refuse"`` (default) raises on communication/FSDP cells; ``"drop"`` leaves them out.

        Raises:
            ValueError: an unknown cell (naming rank, column, text), a stage in two rows, a stage index no row
                uses, no action at all, or a bad ``comms``. Check the result with ``splitgrad.pipeline.validate``.
        """
        from .torch_csv import csv_to_action_rows, placement_of

        rows = csv_to_action_rows(text, comms=comms)
        stage_to_rank, microbatches = placement_of(rows)
        ranks = tuple(tuple(parse_action(a) for a in row) for row in rows)
        return cls(name, microbatches if n_microbatches is None else n_microbatches, stage_to_rank, ranks)

    def to_csv(self) -> str:
        """PyTorch's ``compute_only`` schedule CSV of this schedule; :meth:`from_csv` reads it back.

        Raises:
            ValueError: the schedule has gradient-sync points (``R``/``RF``): strip them first.
        """
        from .torch_csv import action_rows_to_csv

        return action_rows_to_csv([[a.name for a in acts] for acts in self.rank_actions])

    def __repr__(self) -> str:
        return (
            f"Schedule(name={self.name!r}, n_stages={self.n_stages}, n_ranks={self.n_ranks}, "
            f"n_microbatches={self.n_microbatches}, n_actions={self.n_actions})"
        )
