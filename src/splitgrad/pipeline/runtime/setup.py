"""What a :class:`~splitgrad.pipeline.PipelineRuntime` is built from and what a step returns: this rank's place
in the pipeline group, its stage modules, and :class:`StepResult`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from ..ir.actions import Schedule
from ..timeline.events import TimelineEvent
from .comm.stats import CommStats

__all__ = ["StepResult", "own_stages", "resolve_pipeline_rank"]


@dataclass(kw_only=True, slots=True)
class StepResult:
    """What one :meth:`PipelineRuntime.step` returns on one rank."""

    loss: torch.Tensor | None
    """Mean of the microbatch losses, a float64 0-dim tensor on the runtime's device; on every pipeline rank
    with ``broadcast_loss`` (the default), else only on the last stage's rank (None elsewhere)."""
    microbatch_losses: list[torch.Tensor] = field(default_factory=list)
    """Per-microbatch losses (detached) on the last stage's rank; empty elsewhere."""
    events: list[TimelineEvent] = field(default_factory=list)
    """This rank's measured events (seconds since the step's common origin); empty when not recording."""
    peak_activation_bytes: int | None = None
    """With ``track_memory``: peak activation bytes this rank held: what autograd saved in each forward until
    its ``B``, then exactly the wgrad operands parked for its ``W`` (see :class:`~.recording.ActivationMeter`)."""
    duration: float = 0.0
    """Seconds from the step origin until this rank's sends were delivered and its data-parallel reductions
    finished (the loss broadcast not included)."""
    w_tasks: int = 0
    """Deferred weight-gradient tasks this rank's ``W`` actions ran (0 when nothing was split)."""
    comm: CommStats | None = None
    """How this rank's messages moved (when each receive was posted vs needed, headers, held buffer bytes);
    None on a one-rank pipeline."""
    runtime_cpu: float = 0.0
    """CPU seconds (this thread's ``time.thread_time``) the step spent outside its actions' handlers: posting
    and completing messages, the interpreter loop, timeline bookkeeping. Blocking waits use no CPU, so this is
    the runtime's own per-step cost whatever the machine's load (divide by the rank's action count for the
    cost per action)."""
    action_cpu: float = 0.0
    """CPU seconds inside the actions' handlers (compute, and queueing what they produced)."""


def resolve_pipeline_rank(
    schedule: Schedule, *, rank: int | None = None, pp_group: dist.ProcessGroup | None = None, who: str
) -> int:
    """This process's rank in ``schedule``, after checking that the pipeline group fits the schedule.

    The group must have exactly ``schedule.n_ranks`` ranks, in every case: a one-rank schedule under a larger
    group would silently run the whole model on every rank, and a multi-rank schedule without
    ``torch.distributed`` could only fail later, mid-step.

    Args:
        schedule: the schedule to run.
        rank: the rank asked for (None: this process's rank in ``pp_group``, or 0 without a process group).
        pp_group: the pipeline group (None: the default group, when torch.distributed is initialised).
        who: the caller, named in error messages.

    Raises:
        RuntimeError: a multi-rank schedule while torch.distributed is not initialised.
        ValueError: the group's size differs from ``schedule.n_ranks``, this process is not in the group,
            or ``rank`` is not this process's rank in it (or outside the schedule).
    """
    n_ranks = schedule.n_ranks
    if not (dist.is_available() and dist.is_initialized()):
        if pp_group is not None or n_ranks > 1:
            raise RuntimeError(
                f"{who}: schedule {schedule.name!r} spans {n_ranks} ranks but torch.distributed is not "
                f"initialised (no process group for n_ranks={n_ranks}); call torch.distributed.init_process_group() on every rank first (and pass the "
                "pipeline's pp_group), or build a one-rank schedule"
            )
        rank = 0 if rank is None else rank
    else:
        group_size = dist.get_world_size(pp_group)
        group_rank = dist.get_rank(pp_group)
        group = "the default process group" if pp_group is None else "pp_group"
        if group_rank < 0:
            raise ValueError(
                f"{who}: this process (global rank {dist.get_rank()}) is not a member of pp_group; pass the "
                "pipeline group this process belongs to"
            )
        if group_size != n_ranks:
            hint = (
                " (each of its ranks would run the whole model); pass a one-rank pp_group, e.g. from "
                "pipeline_groups(1, dp_size)"
                if n_ranks == 1
                else ""
            )
            raise ValueError(
                f"{who}: schedule {schedule.name!r} has n_ranks={n_ranks} but {group} has {group_size} "
                f"ranks{hint}; build the schedule for {group_size} ranks or pass a pp_group of {n_ranks}"
            )
        if rank is None:
            rank = group_rank
        elif rank != group_rank:
            raise ValueError(
                f"{who}: rank={rank} but this process is rank {group_rank} of {group} "
                f"({group_size} ranks) running schedule {schedule.name!r}"
            )
    if not 0 <= rank < n_ranks:
        raise ValueError(f"{who}: {rank=} outside the schedule's ranks 0..{n_ranks - 1}")
    return rank


def own_stages(
    schedule: Schedule, rank: int, stages: Mapping[int, nn.Module] | Sequence[nn.Module]
) -> dict[int, nn.Module]:
    """``{stage: module}`` of the stages ``schedule`` gives ``rank``, from any form
    :class:`~splitgrad.pipeline.PipelineRuntime` accepts (a mapping, all stages, or this rank's stages).

    Raises:
        ValueError: the modules do not match the rank's stages. TypeError: a stage is not an ``nn.Module``.
    """
    mine = schedule.stages_of(rank)
    if isinstance(stages, Mapping):
        owned = {int(k): v for k, v in stages.items()}
    elif len(stages) == schedule.n_stages:
        owned = {s: stages[s] for s in mine}
    elif len(stages) == len(mine):
        owned = dict(zip(mine, stages))
    else:
        raise ValueError(
            f"PipelineRuntime: got {len(stages)} stage modules; pass all {schedule.n_stages} stages of "
            f"the model or the {len(mine)} this rank holds (stages {list(mine)} of schedule "
            f"{schedule.name!r})"
        )
    if sorted(owned) != list(mine):
        raise ValueError(
            f"PipelineRuntime: pipeline rank {rank} runs stages {list(mine)} of schedule "
            f"{schedule.name!r}, got modules for stages {sorted(owned)}"
        )
    bad = [s for s, m in owned.items() if not isinstance(m, nn.Module)]
    if bad:
        raise TypeError(f"PipelineRuntime: stages {bad} are not nn.Modules")
    return owned
