"""PyTorch's pipeline-schedule CSV, translated cell by cell to and from splitgrad's action strings.

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

This module only translates text (``"2I3"`` <-> ``"2B3"``, ``"(0F7;7B3)OVERLAP_F_B"`` <-> ``"0F7+7BW3"``) and
imports nothing from splitgrad; :meth:`~.actions.Schedule.from_csv` and :meth:`~.actions.Schedule.to_csv` parse
the action strings with splitgrad's own grammar and build or read the :class:`~.actions.Schedule`.
"""

from __future__ import annotations

import csv
import io
import re

__all__ = ["action_rows_to_csv", "csv_to_action_rows", "placement_of"]

_FROM_TORCH = {"F": "F", "I": "B", "W": "W", "B": "BW"}
_TO_TORCH = {kind: letter for letter, kind in _FROM_TORCH.items()}
_COMPUTE_RE = re.compile(r"^(\d+)([FIWB])(\d+)$")
_SPLITGRAD_RE = re.compile(r"^(\d+)(F|BW|B|W)(\d+)$")
_OVERLAP_RE = re.compile(r"^\((.+);(.+)\)OVERLAP_F_B$")
_COMM_RE = re.compile(r"^(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|UNSHARD|RESHARD|REDUCE_GRAD)(\d*)$")


def csv_to_action_rows(text: str, *, comms: str = "refuse") -> list[list[str]]:
    """PyTorch's schedule CSV as splitgrad action strings, one list per rank (idle cells dropped).

    Args:
        text: the file's content, one row per rank (``\\r\\n`` or ``\\n`` line ends).
        comms: ``"refuse"`` (default) raises on communication/FSDP cells; ``"drop"`` leaves them out.

    Returns:
        ``[["0F0", "0F1", "0F2+3BW0", ...], ...]``: rank ``r``'s actions in splitgrad's compact form.

    Raises:
        ValueError: an unknown cell (naming its rank, column and text), a pair that is not an ``F`` with a
            ``B``/``I``, a communication cell under ``comms="refuse"``, or a bad ``comms``.
    """
    if comms not in ("refuse", "drop"):
        raise ValueError(f"schedule_from_csv: comms must be 'refuse' or 'drop', got {comms=!r}")
    rows = [row for row in csv.reader(io.StringIO(text)) if row]
    out: list[list[str]] = []
    for rank, row in enumerate(rows):
        actions: list[str] = []
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
            actions.append(_from_cell(cell, rank, column))
        out.append(actions)
    return out


def placement_of(rows: list[list[str]]) -> tuple[tuple[int, ...], int]:
    """``(stage_to_rank, microbatches)`` of :func:`csv_to_action_rows`' output: a stage's rank is its row.

    Raises:
        ValueError: a stage in two rows, a stage index that no row uses, or no action at all.
    """
    stage_to_rank: dict[int, int] = {}
    last_microbatch = -1
    for rank, actions in enumerate(rows):
        for part in (p for action in actions for p in action.split("+")):
            stage, _, microbatch = _SPLITGRAD_RE.match(part).groups()
            if stage_to_rank.setdefault(int(stage), rank) != rank:
                raise ValueError(
                    f"schedule_from_csv: stage {stage} has actions on rank {stage_to_rank[int(stage)]} and on rank "
                    f"{rank} ({part}); a stage runs on one rank"
                )
            last_microbatch = max(last_microbatch, int(microbatch))
    if not stage_to_rank:
        raise ValueError("schedule_from_csv: the CSV holds no compute action")
    n_stages = max(stage_to_rank) + 1
    missing = sorted(set(range(n_stages)) - set(stage_to_rank))
    if missing:
        raise ValueError(
            f"schedule_from_csv: stages {missing} have no action (stages 0..{n_stages - 1} expected)"
        )
    return tuple(stage_to_rank[s] for s in range(n_stages)), last_microbatch + 1


def action_rows_to_csv(rows: list[list[str]]) -> str:
    """PyTorch's ``compute_only`` CSV (``\\n`` line ends, no idle cells) of splitgrad action strings per rank.

    Raises:
        ValueError: a gradient-sync point (``"0R"``, ``"0RF"``), which this format has no cell for
            (``splitgrad.pipeline.passes.strip_grad_sync`` removes them).
    """
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    for rank, actions in enumerate(rows):
        writer.writerow([_to_cell(action, rank) for action in actions])
    return out.getvalue()


def _from_cell(cell: str, rank: int, column: int) -> str:
    pair = _OVERLAP_RE.match(cell)
    if pair is not None:
        forward, backward = (_from_cell(part.strip(), rank, column) for part in pair.groups())
        if _SPLITGRAD_RE.match(forward)[2] != "F" or _SPLITGRAD_RE.match(backward)[2] not in ("B", "BW"):
            raise ValueError(
                f"schedule_from_csv: rank {rank} column {column}: {cell!r} must overlap an F action with a B "
                "or I action"
            )
        return f"{forward}+{backward}"
    return _rename_kind(
        cell,
        _COMPUTE_RE,
        _FROM_TORCH,
        f"schedule_from_csv: rank {rank} column {column}: cannot parse {cell!r}; expected "
        "'<stage><F|I|W|B><microbatch>' (e.g. '2I3') or '(<F action>;<B action>)OVERLAP_F_B'",
    )


def _to_cell(action: str, rank: int) -> str:
    if "+" in action:
        forward, _, backward = action.partition("+")
        return f"({_to_cell(forward, rank)};{_to_cell(backward, rank)})OVERLAP_F_B"
    return _rename_kind(
        action,
        _SPLITGRAD_RE,
        _TO_TORCH,
        f"schedule_to_csv: rank {rank} has the gradient-sync point {action}; PyTorch's compute_only CSV has "
        "no cell for it (strip it with splitgrad.pipeline.passes.strip_grad_sync)",
    )


def _rename_kind(text: str, pattern: re.Pattern[str], kinds: dict[str, str], error: str) -> str:
    """``text`` (``<stage><kind><microbatch>``, matched by ``pattern``) with its kind renamed through ``kinds``
    (the two formats name the same actions differently); ``ValueError(error)`` when it does not match."""
    match = pattern.match(text)
    if match is None:
        raise ValueError(error)
    stage, kind, microbatch = match.groups()
    return f"{stage}{kinds[kind]}{microbatch}"
