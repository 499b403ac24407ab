"""PyTorch's pipeline-schedule CSV read as a :class:`~.actions.Schedule`, and a schedule written in it.

The format is ``torch.distributed.pipelining``'s (torch 2.13: ``PipelineScheduleMulti._dump_csv`` /
``_load_csv``, ``_PipelineScheduleRuntime._load_csv``; torchtitan's ``pipeline_parallel_schedule_csv``): one
row per rank, one cell per action, each cell ``str(_Action)``:

* ``"<stage><type><microbatch>"`` with type ``F`` (forward), ``I`` (input gradient: splitgrad's ``B``), ``W``
  (weight gradient) or ``B`` (*full* backward: splitgrad's ``BW``), e.g. ``"0F1"``, ``"2I3"``, ``"7W0"``;
* ``"(<F action>;<B or I action>)OVERLAP_F_B"``, an overlapped pair (splitgrad's
  :class:`~.actions.OverlapAction`), e.g. ``"(0F7;7B3)OVERLAP_F_B"``;
* an empty cell: the rank idles for one step of PyTorch's step-count simulator. splitgrad's schedules carry
  no idle steps (its simulator derives waits from dependencies), so empty cells are dropped;
* in the ``compute_comms`` format also ``SEND_F``/``RECV_F``/``SEND_B``/``RECV_B``/``UNSHARD``/``RESHARD``/
  ``REDUCE_GRAD`` cells. splitgrad derives its messages from the compute order
  (:meth:`~.actions.Schedule.receives`), so these are refused unless ``comms="drop"``.

Stages are global stage indices; a stage's rank is the row its actions are in.
"""

from __future__ import annotations

import csv
import io
import re

from .actions import Action, ActionKind, AnyAction, OverlapAction, Schedule

__all__ = ["schedule_from_csv", "schedule_to_csv"]

_FROM_TORCH = {"F": ActionKind.F, "I": ActionKind.B, "W": ActionKind.W, "B": ActionKind.BW}
_TO_TORCH = {kind: letter for letter, kind in _FROM_TORCH.items()}
_COMPUTE_RE = re.compile(r"^(\d+)([FIWB])(\d+)$")
_OVERLAP_RE = re.compile(r"^\((.+);(.+)\)OVERLAP_F_B$")
_COMM_RE = re.compile(r"^(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|UNSHARD|RESHARD|REDUCE_GRAD)(\d*)$")


def schedule_from_csv(
    text: str, *, n_microbatches: int | None = None, name: str = "csv", comms: str = "refuse"
) -> Schedule:
    """Parse PyTorch's schedule CSV (the module docstring gives the format).

    Args:
        text: the file's content, one row per rank (``\\r\\n`` or ``\\n`` line ends).
        n_microbatches: microbatches per step (default: the largest index in the file, plus one).
        name: the schedule's name.
        comms: ``"refuse"`` (default) raises on communication/FSDP cells; ``"drop"`` leaves them out.

    Returns:
        The :class:`Schedule`; check it with :func:`splitgrad.pipeline.validate`.

    Raises:
        ValueError: an unknown cell (naming its rank, column and text), a stage in two rows, a stage index
            that no row uses, no action at all, or a bad ``comms``.
    """
    if comms not in ("refuse", "drop"):
        raise ValueError(f"schedule_from_csv: comms must be 'refuse' or 'drop', got {comms=!r}")
    rows = [row for row in csv.reader(io.StringIO(text)) if row]
    rank_actions: list[list[AnyAction]] = []
    stage_to_rank: dict[int, int] = {}
    for rank, row in enumerate(rows):
        actions: list[AnyAction] = []
        for column, cell in enumerate(row):
            cell = cell.strip()
            if not cell:
                continue  # an idle step of PyTorch's simulator
            if _COMM_RE.match(cell):
                if comms == "refuse":
                    raise ValueError(
                        f"schedule_from_csv: rank {rank} column {column}: {cell!r} is a communication/FSDP cell "
                        "of PyTorch's compute_comms format; splitgrad derives messages from the compute order, "
                        "pass comms='drop' to leave them out"
                    )
                continue
            action = _parse_cell(cell, rank, column)
            for part in action.parts:
                seen = stage_to_rank.setdefault(part.stage, rank)
                if seen != rank:
                    raise ValueError(
                        f"schedule_from_csv: stage {part.stage} has actions on rank {seen} and on rank {rank} "
                        f"(column {column}, {cell!r}); a stage runs on one rank"
                    )
            actions.append(action)
        rank_actions.append(actions)
    if not stage_to_rank:
        raise ValueError("schedule_from_csv: the CSV holds no compute action")
    n_stages = max(stage_to_rank) + 1
    missing = sorted(set(range(n_stages)) - set(stage_to_rank))
    if missing:
        raise ValueError(f"schedule_from_csv: stages {missing} have no action (stages 0..{n_stages - 1} expected)")
    if n_microbatches is None:
        n_microbatches = 1 + max(p.microbatch for acts in rank_actions for a in acts for p in a.parts)
    return Schedule(
        name=name,
        n_microbatches=n_microbatches,
        stage_to_rank=tuple(stage_to_rank[s] for s in range(n_stages)),
        rank_actions=tuple(tuple(acts) for acts in rank_actions),
    )


def schedule_to_csv(schedule: Schedule) -> str:
    """Write ``schedule`` in PyTorch's ``compute_only`` CSV format (``\\n`` line ends, no idle cells).

    ``PipelineScheduleMulti._load_csv`` and ``_PipelineScheduleRuntime._load_csv`` read it, and
    :func:`schedule_from_csv` reads it back to an equal schedule.

    Raises:
        ValueError: the schedule has gradient-sync points (``R``/``RF``), which this format has no cell for
            (``splitgrad.pipeline.passes.strip_grad_sync`` removes them).
    """
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    for rank, actions in enumerate(schedule.rank_actions):
        writer.writerow([_cell(action, rank) for action in actions])
    return out.getvalue()


def _parse_cell(cell: str, rank: int, column: int) -> AnyAction:
    pair = _OVERLAP_RE.match(cell)
    if pair is not None:
        forward, backward = (_parse_cell(part.strip(), rank, column) for part in pair.groups())
        if (
            type(forward) is not Action
            or type(backward) is not Action
            or forward.kind is not ActionKind.F
            or backward.kind not in (ActionKind.B, ActionKind.BW)
        ):
            raise ValueError(
                f"schedule_from_csv: rank {rank} column {column}: {cell!r} must overlap an F action with a B "
                "or I action"
            )
        return OverlapAction(forward, backward)
    match = _COMPUTE_RE.match(cell)
    if match is None:
        raise ValueError(
            f"schedule_from_csv: rank {rank} column {column}: cannot parse {cell!r}; expected "
            "'<stage><F|I|W|B><microbatch>' (e.g. '2I3') or '(<F action>;<B action>)OVERLAP_F_B'"
        )
    stage, letter, microbatch = match.groups()
    return Action(int(stage), _FROM_TORCH[letter], int(microbatch))


def _cell(action: AnyAction, rank: int) -> str:
    if type(action) is OverlapAction:
        return f"({_cell(action.forward, rank)};{_cell(action.backward, rank)})OVERLAP_F_B"
    if action.kind not in _TO_TORCH:
        raise ValueError(
            f"schedule_to_csv: rank {rank} has the gradient-sync point {action}; PyTorch's compute_only CSV has "
            "no cell for it (strip it with splitgrad.pipeline.passes.strip_grad_sync)"
        )
    return f"{action.stage}{_TO_TORCH[action.kind]}{action.microbatch}"
