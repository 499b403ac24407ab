"""splitgrad schedules as ``torch.distributed.pipelining`` action lists, and back.

PyTorch keeps a schedule as ``pipeline_order``: ``{rank: [_Action | None, ...]}``, each ``_Action`` a
``(stage, computation type, microbatch)`` whose ``str`` is a cell of its schedule CSV. :func:`to_torch_actions`
gives a splitgrad :class:`~splitgrad.pipeline.Schedule` in that form, so PyTorch's own schedule tooling
(``_validate_schedule``, ``_add_send_recv``, ``_simulate_comms_compute``, ``_PipelineScheduleRuntime``) can
check and run it; :func:`from_torch_actions` reads a PyTorch schedule's order back. Both go through the CSV
cell form of :mod:`splitgrad.pipeline.ir.torch_csv` (``I`` is splitgrad's ``B``, ``B`` its ``BW``,
``OVERLAP_F_B`` its ``OverlapAction``), so there is one mapping.

``_Action`` is private to torch (2.13); this module is where splitgrad depends on it.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Mapping, Sequence
from typing import Any

from torch.distributed.pipelining.schedules import _Action

from .ir.actions import Schedule

__all__ = ["from_torch_actions", "to_torch_actions"]


def to_torch_actions(schedule: Schedule) -> dict[int, list[Any]]:
    """``{rank: [torch _Action, ...]}`` of ``schedule``, in its order (PyTorch's ``pipeline_order``).

    Raises:
        ValueError: the schedule has gradient-sync points (``R``/``RF``), which PyTorch spells differently
            (``REDUCE_GRAD``, added by its own lowering).
    """
    rows = csv.reader(io.StringIO(schedule.to_csv()))
    return {rank: [_Action.from_str(cell) for cell in row] for rank, row in enumerate(rows)}


def from_torch_actions(
    pipeline_order: Mapping[int, Sequence[Any]], *, n_microbatches: int | None = None, name: str = "torch"
) -> Schedule:
    """A splitgrad :class:`Schedule` from PyTorch's ``{rank: [_Action | None, ...]}`` (``None``: an idle step).

    Args:
        pipeline_order: a PyTorch schedule's ``pipeline_order`` (compute actions; ranks ``0..n-1``).
        n_microbatches: microbatches per step (default: the largest index, plus one).
        name: the schedule's name.

    Raises:
        ValueError: ranks not numbered ``0..n-1``, or an action splitgrad's CSV reader refuses (see
            :func:`splitgrad.pipeline.ir.torch_csv.schedule_from_csv`).
    """
    if sorted(pipeline_order) != list(range(len(pipeline_order))):
        raise ValueError(f"from_torch_actions: ranks must be 0..n-1, got {sorted(pipeline_order)}")
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    for rank in range(len(pipeline_order)):
        writer.writerow(["" if a is None else str(a) for a in pipeline_order[rank]])
    return Schedule.from_csv(out.getvalue(), n_microbatches=n_microbatches, name=name)
