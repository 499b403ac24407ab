"""Pipeline schedules as data: actions, schedule builders, validation, simulation and timelines.

Nothing here starts processes or imports torch until a runtime name is used; a runtime interprets the
:class:`Schedule` objects built here.

Typical use::

    from splitgrad.pipeline import build_schedule, simulate, validate

    sched = build_schedule("zb-h1", n_stages=4, n_microbatches=8)
    validate(sched)
    result = simulate(sched, f=1.0, b=1.0, w=1.0)
    print(result.bubble_ratio, result.peak_activations)
    print(result.to_ascii())

The rest lives in its room: the action grammar, overlapped pairs, diagnostics and the simulator in
:mod:`~splitgrad.pipeline.ir` (``parse_action``, ``OverlapAction``, ``find_problems``), builders and the name
list in :mod:`~splitgrad.pipeline.schedules` (``zb_h1``, ``schedule_names()``), passes in
:mod:`~splitgrad.pipeline.passes` (``add_grad_sync``, ``fuse_overlap_pairs``), renderers and measured-vs-simulated
analysis in :mod:`~splitgrad.pipeline.timeline`, and the torch.distributed runtime in
:mod:`~splitgrad.pipeline.runtime`, the only room that imports torch. The module paths
documented before (``splitgrad.pipeline.actions``, ``.validate``, ``.simulate``, ``.measure``, ``.build``) are
kept as thin aliases of the new homes.
"""

from __future__ import annotations

import importlib
import warnings
from typing import TYPE_CHECKING

from .ir.actions import Action, ActionKind, Schedule, ScheduleError
from .schedules import build_schedule

# ``simulate`` and ``validate`` also name modules of this package (the public paths of ir.simulate and
# ir.validate): importing the functions through them loads those modules now, so that a later ``import
# splitgrad.pipeline.simulate`` finds them loaded and cannot rebind this package's ``simulate`` to the module.
from .simulate import SimulationResult, simulate
from .validate import validate

if TYPE_CHECKING:  # type checkers and IDEs see the lazy runtime names as ordinary imports
    from .runtime import PipelineRuntime, StepResult, build_runtime, pipeline_groups

__all__ = [
    "Action",
    "ActionKind",
    "PipelineRuntime",
    "Schedule",
    "ScheduleError",
    "SimulationResult",
    "StepResult",
    "build_runtime",
    "build_schedule",
    "pipeline_groups",
    "simulate",
    "validate",
]

# The runtime (torch.distributed) loads on first use, so the schedule tools above stay light.
_RUNTIME = ("PipelineRuntime", "StepResult", "build_runtime", "pipeline_groups")

# Names this package exported before issue 12 trimmed it, by the module they live in now (issue 24 moved those
# modules into the ir/, passes/, timeline/ and runtime/ rooms). They keep working for a while, with a
# DeprecationWarning naming the new import.
_MOVED = {
    name: home
    for home, names in (
        ("ir.actions", "COMPUTE_KINDS SYNC_KINDS AnyAction OverlapAction Transfer parse_action"),
        ("ir.validate", "channel_order_problems find_problems render_listing"),
        ("passes", "add_grad_sync has_grad_sync strip_grad_sync"),
        (
            "schedules",
            "AutoCandidate auto_candidates dualpipev gpipe greedy_schedule interleaved_1f1b one_f_one_b "
            "schedule_names schedule_options zb_auto zb_h1 zb_h2 zbv",
        ),
        ("schedules.registry", "SCHEDULES"),
        ("timeline", "TimelineEvent render_ascii save_png to_chrome_trace write_chrome_trace"),
        (
            "timeline",
            "idle_breakdown bubble_report measured_bubble_ratio save_measured_timeline simulate_measured",
        ),
        ("runtime", "PipelineGroups sequential_stages"),
    )
    for name in names.split()
}


def __getattr__(name: str) -> object:
    if name in _RUNTIME:
        return getattr(importlib.import_module(f"{__name__}.runtime"), name)
    if name in _MOVED:
        where = f"{__name__}.{_MOVED[name]}"
        warnings.warn(
            f"splitgrad.pipeline.{name} moved: import it from {where}", DeprecationWarning, stacklevel=2
        )
        return getattr(importlib.import_module(where), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
