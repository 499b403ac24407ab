"""A schedule made ready for one rank: the rank it runs in the pipeline group, and the schedule lowered for it.

Both are decided before anything runs, from the schedule and the group alone, so that a schedule that does not
fit fails on every rank at build time, naming the schedule and the sizes, never mid-step. Lowering adds what
the runtime will do to the schedule as data: the gradient-sync points of the stages that reduce gradients
(:func:`~splitgrad.pipeline.passes.add_grad_sync`), so the simulator, the timelines and the goldens see them.
"""

from __future__ import annotations

from collections.abc import Collection

import torch.distributed as dist

from ..ir.actions import Action, ActionKind, Schedule
from ..passes import add_grad_sync, has_grad_sync

__all__ = ["lower_schedule", "resolve_pipeline_rank"]


def check_options(*, timeout: float, prefetch_depth: int) -> None:
    """Raise ``ValueError`` naming a :class:`~.PipelineRuntime` option that cannot work."""
    if not timeout > 0:
        raise ValueError(f"PipelineRuntime: timeout must be positive seconds, got {timeout=}")
    if isinstance(prefetch_depth, bool) or not isinstance(prefetch_depth, int) or prefetch_depth < 1:
        raise ValueError(f"PipelineRuntime: prefetch_depth must be an int >= 1, got {prefetch_depth=}")


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


def lower_schedule(schedule: Schedule, rank: int, syncing: Collection[int]) -> Schedule:
    """``schedule`` as ``rank`` runs it: with every stage's gradient-sync points when a local stage reduces
    gradients (``syncing``) and the schedule has none yet (:func:`~splitgrad.pipeline.passes.add_grad_sync`).

    Args:
        schedule: the schedule every rank runs.
        rank: this rank.
        syncing: this rank's stages with a data-parallel wrapper (``no_sync()`` / ``finish_grad_sync()``).

    Raises:
        ValueError: a syncing stage has no ``RF`` point in a schedule that already holds sync points.
    """
    if syncing and not has_grad_sync(schedule):
        schedule = add_grad_sync(schedule)
    unsynced = [s for s in syncing if Action(s, ActionKind.RF, None) not in schedule.rank_actions[rank]]
    if unsynced:
        raise ValueError(
            f"PipelineRuntime: stages {unsynced} sync gradients (no_sync/finish_grad_sync) but schedule "
            f"{schedule.name!r} has no RF point for them; lower it with splitgrad.pipeline.passes.add_grad_sync"
        )
    return schedule


def check_same_layout(old: Schedule, new: Schedule) -> None:
    """Raise unless ``new`` can replace ``old`` between steps: the same stage layout and microbatch count.

    Raises:
        ValueError: naming both layouts and microbatch counts.
    """
    if (new.stage_to_rank, new.n_microbatches) != (old.stage_to_rank, old.n_microbatches):
        raise ValueError(
            f"PipelineRuntime.install_schedule: {new.name!r} maps stages {new.stage_to_rank} with "
            f"{new.n_microbatches} microbatches; the runtime was built for {old.stage_to_rank} with "
            f"{old.n_microbatches}"
        )
