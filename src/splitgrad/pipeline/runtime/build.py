"""The common case in one call: cut a model, lay out pipeline x data-parallel ranks, build the runtime.

* :func:`sequential_stages` cuts any list of blocks (an ``nn.Sequential``, ``GPT.pieces()``) into contiguous
  ``nn.Sequential`` stages; for the GPT/MoE models ``splitgrad.models.split_into_stages`` balances better.
* :func:`pipeline_groups` builds the 2-D layout: ``global rank = dp_rank * pp_size + pp_rank`` (pipeline
  neighbours are adjacent ranks), returning this rank's pipeline and data-parallel groups.
* :func:`build_runtime` takes *all* stages of the model (every rank builds the same model and keeps its own),
  a schedule or schedule name, and optionally a data-parallel group (each local stage is then wrapped in
  :class:`splitgrad.parallel.DistributedDataParallel`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch.distributed as dist
from torch import nn

from ...distributed.grid import grid_groups
from ...distributed.group_ref import GroupRef
from ..ir.actions import Schedule
from .executor import LossFn
from .pipeline_runtime import PipelineRuntime
from .setup import resolve_pipeline_rank

if TYPE_CHECKING:
    from ...parallel import DDPConfig

__all__ = ["PipelineGroups", "build_runtime", "pipeline_groups", "sequential_stages"]

logger = logging.getLogger(__name__)


def sequential_stages(
    blocks: Sequence[nn.Module], n_stages: int, *, sizes: Sequence[int] | None = None
) -> list[nn.Sequential]:
    """Cut ``blocks`` into ``n_stages`` contiguous ``nn.Sequential`` stages (sharing, not copying, the blocks).

    Args:
        blocks: the model as an ordered list of one-tensor-in, one-tensor-out modules.
        n_stages: number of stages.
        sizes: blocks per stage (default: as even as possible, earlier stages one larger).
    """
    blocks = list(blocks)
    if not 1 <= n_stages <= len(blocks):
        raise ValueError(
            f"sequential_stages: need 1 <= n_stages <= len(blocks), got {n_stages=} {len(blocks)=}"
        )
    if sizes is None:
        base, extra = divmod(len(blocks), n_stages)
        sizes = [base + (i < extra) for i in range(n_stages)]
    sizes = [int(n) for n in sizes]
    if len(sizes) != n_stages or sum(sizes) != len(blocks) or min(sizes) < 1:
        raise ValueError(
            f"sequential_stages: sizes must be {n_stages=} positive counts summing to {len(blocks)}, got {sizes}"
        )
    stages, start = [], 0
    for n in sizes:
        stages.append(nn.Sequential(*blocks[start : start + n]))
        start += n
    return stages


class PipelineGroups:
    """This rank's place in a ``pp_size x dp_size`` layout and its two process groups.

    The groups are held weakly (torch's registry holds them until ``dist.destroy_process_group()``): this
    object, kept in a script's globals, must not keep their gloo workers alive to interpreter exit.
    """

    __slots__ = ("_dp", "_pp", "dp_rank", "pp_rank")

    def __init__(
        self, *, pp_rank: int, dp_rank: int, pp_group: dist.ProcessGroup, dp_group: dist.ProcessGroup | None
    ) -> None:
        self.pp_rank = pp_rank
        """Index in the pipeline (the schedule's rank)."""
        self.dp_rank = dp_rank
        """Index of the pipeline replica."""
        self._pp = GroupRef(pp_group, owner="PipelineGroups.pp_group")
        self._dp = None if dp_group is None else GroupRef(dp_group, owner="PipelineGroups.dp_group")

    @property
    def pp_group(self) -> dist.ProcessGroup:
        """The ranks of this replica's pipeline, ``dp_rank * pp_size + [0, pp_size)``."""
        return self._pp.get()

    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        """The ranks holding the same stages in every replica (None when ``dp_size == 1``)."""
        return None if self._dp is None else self._dp.get()

    def __repr__(self) -> str:
        return f"PipelineGroups(pp_rank={self.pp_rank}, dp_rank={self.dp_rank})"


def pipeline_groups(pp_size: int, dp_size: int = 1, *, backend: str | None = None) -> PipelineGroups:
    """Create every pipeline and data-parallel group (a collective: all ranks call it, in the same order).

    Args:
        pp_size: ranks per pipeline.
        dp_size: number of pipeline replicas; ``pp_size * dp_size`` must be the world size.
        backend: backend of the new groups (default: the default group's).
    """
    world = dist.get_world_size()
    if pp_size < 1 or dp_size < 1 or pp_size * dp_size != world:
        raise ValueError(
            f"pipeline_groups: need pp_size * dp_size == world size, got {pp_size=} {dp_size=} {world=}"
        )
    grid = grid_groups(pp_size, backend=backend)
    return PipelineGroups(
        pp_rank=grid.inner_rank,
        dp_rank=grid.outer_rank,
        pp_group=grid.inner_group,
        dp_group=grid.outer_group,
    )


def build_runtime(
    stages: Sequence[nn.Module],
    schedule: Schedule | str,
    *,
    loss_fn: LossFn,
    n_microbatches: int | None = None,
    pp_group: dist.ProcessGroup | None = None,
    dp_group: dist.ProcessGroup | None = None,
    schedule_options: dict[str, Any] | None = None,
    ddp: DDPConfig | None = None,
    **runtime_options: Any,
) -> PipelineRuntime:
    """Build this rank's :class:`PipelineRuntime` from all the model's stages.

    Args:
        stages: every stage of the model, in order (this rank keeps the ones the schedule gives it).
        schedule: a :class:`Schedule`, or a name for :func:`splitgrad.pipeline.build_schedule` (then
            ``n_microbatches`` is required and ``n_stages = len(stages)``). ``"zb-auto"`` without costs in
            ``schedule_options`` (or ``"auto"``) is profile-guided: the first steps run 1F1B with split
            backward and are measured, then zb-auto plans with the measured costs and memory
            (:mod:`splitgrad.pipeline.runtime.autoplan`; ``runtime.planner.plan`` says what it found). Its
            ``schedule_options``: ``memory_budget`` (1F1B-equivalents, default 1.0) or ``memory_budget_bytes``,
            and ``profile_steps`` (default 1).
        loss_fn: see :class:`PipelineRuntime`.
        n_microbatches: microbatches per step, for a schedule given by name.
        pp_group: the pipeline group (None: the default group).
        dp_group: a data-parallel group: wrap each local stage in
            :class:`splitgrad.parallel.DistributedDataParallel` over it, configured by ``ddp``. Zero its
            gradients with ``runtime.zero_grad()``.
        ddp: the data-parallel wrapper's options (:class:`splitgrad.parallel.DDPConfig`); None: its defaults.
            Needs ``dp_group``.
        schedule_options: options of the schedule family (e.g. ``{"split_backward": True}``).
        **runtime_options: the remaining :class:`PipelineRuntime` keyword arguments.
    """
    planner = None
    options = dict(schedule_options or {})
    if isinstance(schedule, str) and (
        schedule.lower() == "auto" or (schedule.lower() == "zb-auto" and not {"f", "b", "w"} & set(options))
    ):
        from .autoplan import ProfileGuidedPlanner, profiling_schedule

        if n_microbatches is None:
            raise ValueError(f"build_runtime: schedule {schedule!r} given by name needs n_microbatches")
        planner = ProfileGuidedPlanner(
            memory_budget=options.pop("memory_budget", None),
            memory_budget_bytes=options.pop("memory_budget_bytes", None),
            profile_steps=options.pop("profile_steps", 1),
        )
        if options:
            raise ValueError(
                f"build_runtime: profile-guided {schedule!r} takes schedule_options memory_budget, "
                f"memory_budget_bytes and profile_steps, got {sorted(options)}"
            )
        if runtime_options.get("record_timeline") is False:
            raise ValueError(
                f"build_runtime: profile-guided {schedule!r} measures the timeline (record_timeline)"
            )
        schedule, schedule_options = profiling_schedule(len(stages), n_microbatches), None
        planner.keep_meter = bool(runtime_options.get("track_memory", False))
        runtime_options["track_memory"] = True
    if isinstance(schedule, str):
        if n_microbatches is None:
            raise ValueError(f"build_runtime: schedule {schedule!r} given by name needs n_microbatches")
        from ..schedules import build_schedule

        schedule = build_schedule(schedule, len(stages), n_microbatches, **(schedule_options or {}))
    elif schedule_options:
        raise ValueError("build_runtime: schedule_options only apply to a schedule given by name")
    if len(stages) != schedule.n_stages:
        raise ValueError(
            f"build_runtime: schedule {schedule.name!r} has {schedule.n_stages} stages, got {len(stages)} modules"
        )
    # Checked before any stage is wrapped (wrapping broadcasts over dp_group): a schedule that does not fit
    # the pipeline group fails here, on every rank, naming the schedule and both sizes.
    rank = resolve_pipeline_rank(
        schedule, rank=runtime_options.pop("rank", None), pp_group=pp_group, who="build_runtime"
    )
    mine: dict[int, nn.Module] = {s: stages[s] for s in schedule.stages_of(rank)}
    if dp_group is not None:
        from ...parallel import DistributedDataParallel

        mine = {s: DistributedDataParallel(m, process_group=dp_group, config=ddp) for s, m in mine.items()}
    elif ddp is not None:
        raise ValueError(f"build_runtime: ddp={ddp!r} needs a dp_group (data parallelism over some group)")
    runtime = PipelineRuntime(
        mine, schedule, loss_fn=loss_fn, rank=rank, pp_group=pp_group, **runtime_options
    )
    runtime.planner = planner
    return runtime
