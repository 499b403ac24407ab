"""``splitgrad.pipeline`` exports the twelve names of issue 12; the rest lives in submodules.

Why: 50 names at the top of one package hid what matters (build, validate, simulate, run). The moved names
keep working from the package for a while with a ``DeprecationWarning`` naming the new import; nothing else
is reachable there.
"""

from __future__ import annotations

import importlib
import types

import pytest

import splitgrad.pipeline as pipeline
from splitgrad.pipeline import passes, runtime, schedules, timeline
from splitgrad.pipeline.ir import actions, validate

TARGET = {
    "Schedule", "Action", "ActionKind", "ScheduleError", "build_schedule", "validate", "simulate",
    "SimulationResult", "PipelineRuntime", "StepResult", "build_runtime", "pipeline_groups",
}  # fmt: skip


def test_the_public_names_are_the_twelve():
    assert set(pipeline.__all__) == TARGET
    for name in pipeline.__all__:
        assert getattr(pipeline, name) is not None


@pytest.mark.parametrize(
    ("name", "home"),
    [
        ("parse_action", actions),
        ("OverlapAction", actions),
        ("find_problems", validate),
        ("add_grad_sync", passes),
        ("zb_h1", schedules),
        ("schedule_names", schedules),
        ("write_chrome_trace", timeline),
        ("idle_breakdown", timeline),
        ("SCHEDULES", schedules.registry),
        ("sequential_stages", runtime),
    ],
)
def test_moved_names_warn_and_resolve_to_their_home(name, home):
    with pytest.warns(DeprecationWarning, match=rf"import it from {home.__name__}"):
        assert getattr(pipeline, name) is getattr(home, name)


def test_unknown_names_still_raise():
    # Negative check: the shim answers only for names that moved.
    with pytest.raises(AttributeError, match="no attribute 'zb_h3'"):
        pipeline.zb_h3  # noqa: B018
    assert "SCHEDULES" not in schedules.__all__  # one way to list schedules: schedule_names()


@pytest.mark.parametrize(
    ("old", "home"),
    [
        ("splitgrad.pipeline.actions", "splitgrad.pipeline.ir.actions"),
        ("splitgrad.pipeline.validate", "splitgrad.pipeline.ir.validate"),
        ("splitgrad.pipeline.simulate", "splitgrad.pipeline.ir.simulate"),
        ("splitgrad.pipeline.build", "splitgrad.pipeline.runtime.build"),
    ],
)
def test_documented_module_paths_are_their_new_homes(old, home):
    """The module paths documented before issue 24 still import, and hand out the new home itself."""
    assert importlib.import_module(old) is importlib.import_module(home)
    # Importing a module named like one of the package's functions leaves the function in place.
    assert callable(pipeline.simulate) and not isinstance(pipeline.simulate, types.ModuleType)
    assert callable(pipeline.validate) and not isinstance(pipeline.validate, types.ModuleType)
    # Not trivially passing: another room's module is not taken for it.
    assert importlib.import_module(old) is not importlib.import_module("splitgrad.pipeline.passes.grad_sync")


def test_measure_keeps_both_halves():
    """``splitgrad.pipeline.measure`` was split along the torch line; its old names resolve to both halves."""
    from splitgrad.pipeline import measure
    from splitgrad.pipeline.runtime import recording

    assert measure.TimelineRecorder is recording.TimelineRecorder
    assert measure.idle_breakdown is timeline.idle_breakdown
    assert set(measure.__all__) >= {
        "ActivationMeter",
        "gather_events",
        "simulate_measured",
        "profiler_active",
    }
