"""The gradient-sync pass: a stage's data-parallel reduction as points in its rank's action list.

torch.distributed.pipelining lowers its compute-only schedules by adding communication and ``REDUCE_GRAD``
actions; the simulator, timelines and golden files then see what the runtime will do. Here:

* :func:`add_grad_sync` adds the data-parallel gradient-sync points of every stage: ``R`` (reductions may start:
  the stage's data-parallel wrapper leaves ``no_sync()``) just before the stage's last input-gradient action,
  once every forward has counted its gradient contributions, so buckets launch as their last contribution —
  often a ``W`` — arrives; and ``RF`` (finish: launch what is left and wait) after the stage's last compute,
  at the end of its rank's list so that a waiting reduction never delays another stage's compute.
* :func:`strip_grad_sync` removes them again.
"""

from __future__ import annotations

from ..ir.actions import SYNC_KINDS, Action, ActionKind, AnyAction, Schedule

__all__ = ["add_grad_sync", "has_grad_sync", "strip_grad_sync"]

_BACKWARD = (ActionKind.B, ActionKind.BW)


def has_grad_sync(schedule: Schedule) -> bool:
    """Whether ``schedule`` holds any gradient-sync point."""
    return any(a.kind in SYNC_KINDS for acts in schedule.rank_actions for a in acts)


def strip_grad_sync(schedule: Schedule) -> Schedule:
    """``schedule`` without its gradient-sync points."""
    return Schedule(
        name=schedule.name,
        n_microbatches=schedule.n_microbatches,
        stage_to_rank=schedule.stage_to_rank,
        rank_actions=tuple(
            tuple(a for a in acts if a.kind not in SYNC_KINDS) for acts in schedule.rank_actions
        ),
    )


def add_grad_sync(schedule: Schedule, stages: set[int] | None = None) -> Schedule:
    """Add the gradient-sync points ``R`` and ``RF`` of every stage (or of ``stages``) to ``schedule``.

    Per stage: ``R`` right before its last ``B``/``BW`` (after it when that action is an overlapped pair
    whose forward part is the same stage's), ``RF`` at the end of its rank's list, stages in the order their
    last compute action runs. Existing sync points are replaced.

    Args:
        schedule: a complete schedule (see :func:`splitgrad.pipeline.validate`).
        stages: the stages to synchronise; default: all.

    Returns:
        A new schedule with the same name.

    Raises:
        ValueError: ``stages`` names a stage outside the schedule, or a stage has no backward action.
    """
    base = strip_grad_sync(schedule) if has_grad_sync(schedule) else schedule
    wanted = set(range(base.n_stages)) if stages is None else {int(s) for s in stages}
    bad = sorted(s for s in wanted if not 0 <= s < base.n_stages)
    if bad:
        raise ValueError(f"add_grad_sync: stages {bad} outside 0..{base.n_stages - 1} of {base.name!r}")
    lowered: list[tuple[AnyAction, ...]] = []
    for r, acts in enumerate(base.rank_actions):
        mine = [s for s in base.stages_of(r) if s in wanted]
        last_backward: dict[int, int] = {}
        last_compute: dict[int, int] = {}
        for pos, whole in enumerate(acts):
            for part in whole.parts:
                last_compute[part.stage] = pos
                if part.kind in _BACKWARD:
                    last_backward[part.stage] = pos
        missing = [s for s in mine if s not in last_backward]
        if missing:
            raise ValueError(
                f"add_grad_sync: stages {missing} of schedule {base.name!r} have no B/BW action on rank {r}"
            )
        opens: dict[int, list[AnyAction]] = {}
        for s in mine:
            pos = last_backward[s]
            forward_here = any(p.kind is ActionKind.F and p.stage == s for p in acts[pos].parts)
            # R must follow the stage's last forward: inside a pair that also forwards the stage, go after it.
            opens.setdefault(pos + 1 if forward_here else pos, []).append(Action(s, ActionKind.R, None))
        out: list[AnyAction] = []
        for pos, whole in enumerate(acts):
            out.extend(opens.get(pos, ()))
            out.append(whole)
        out.extend(opens.get(len(acts), ()))
        out.extend(Action(s, ActionKind.RF, None) for s in sorted(mine, key=last_compute.__getitem__))
        lowered.append(tuple(out))
    return Schedule(
        name=base.name,
        n_microbatches=base.n_microbatches,
        stage_to_rank=base.stage_to_rank,
        rank_actions=tuple(lowered),
    )
