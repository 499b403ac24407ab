"""Pipeline schedules as data: actions, schedule builders, validation, simulation and timelines.

Nothing here starts processes or imports torch; a runtime interprets the :class:`Schedule` objects built here.

Typical use::

    from splitgrad.pipeline import build_schedule, simulate, validate

    sched = build_schedule("zb-h1", n_stages=4, n_microbatches=8)
    validate(sched)
    result = simulate(sched, f=1.0, b=1.0, w=1.0)
    print(result.bubble_ratio, result.peak_activations)
    print(result.to_ascii())
"""

from __future__ import annotations

from .actions import (
    COMPUTE_KINDS,
    SYNC_KINDS,
    Action,
    ActionKind,
    AnyAction,
    OverlapAction,
    Schedule,
    ScheduleError,
    Transfer,
    parse_action,
)
from .passes import add_grad_sync, has_grad_sync, strip_grad_sync
from .schedules import (
    SCHEDULES,
    AutoCandidate,
    auto_candidates,
    build_schedule,
    dualpipev,
    gpipe,
    greedy_schedule,
    interleaved_1f1b,
    one_f_one_b,
    schedule_names,
    schedule_options,
    zb_auto,
    zb_h1,
    zb_h2,
    zbv,
)
from .simulate import SimulationResult, simulate
from .timeline import TimelineEvent, render_ascii, save_png, to_chrome_trace, write_chrome_trace
from .validate import channel_order_problems, find_problems, render_listing, validate

__all__ = [
    "COMPUTE_KINDS",
    "SCHEDULES",
    "SYNC_KINDS",
    "Action",
    "ActionKind",
    "AnyAction",
    "AutoCandidate",
    "OverlapAction",
    "Schedule",
    "ScheduleError",
    "SimulationResult",
    "TimelineEvent",
    "Transfer",
    "add_grad_sync",
    "auto_candidates",
    "build_schedule",
    "channel_order_problems",
    "dualpipev",
    "find_problems",
    "gpipe",
    "greedy_schedule",
    "has_grad_sync",
    "interleaved_1f1b",
    "one_f_one_b",
    "parse_action",
    "render_ascii",
    "render_listing",
    "save_png",
    "schedule_names",
    "schedule_options",
    "simulate",
    "strip_grad_sync",
    "to_chrome_trace",
    "validate",
    "write_chrome_trace",
    "zb_auto",
    "zb_h1",
    "zb_h2",
    "zbv",
]

# -- runtime (torch.distributed): loaded on first use, so the schedule tools above stay light ------------
_RUNTIME_EXPORTS = {
    "PipelineGroups": "build",
    "PipelineRuntime": "runtime",
    "StepResult": "runtime",
    "build_runtime": "build",
    "idle_breakdown": "measure",
    "bubble_report": "measure",
    "measured_bubble_ratio": "measure",
    "pipeline_groups": "build",
    "save_measured_timeline": "measure",
    "sequential_stages": "build",
    "simulate_measured": "measure",
}


def __getattr__(name: str):
    if name in _RUNTIME_EXPORTS:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_RUNTIME_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ += sorted(_RUNTIME_EXPORTS)
