"""A wgrad task's profiler range and label cost nothing without a profiler, and show up with one.

Why: one task is made per backward of every split layer and run at ``backward_dw``; formatting the layer's
name and opening a ``record_function`` range each time cost more than a small layer's W. They are needed only
in errors and while a profiler records.
"""

from __future__ import annotations

import torch

import splitgrad
from splitgrad.core import WeightGradStore, WgradTask
from splitgrad.core.profiling import profiler_active


def _counting_label(calls: list[int]):
    def label() -> str:
        calls.append(1)
        return "layer0"

    return label


def test_the_label_is_formatted_only_when_shown():
    calls: list[int] = []
    ran: list[int] = []
    task = WgradTask(lambda: ran.append(1), store=WeightGradStore(), label=_counting_label(calls))
    assert not profiler_active()
    task.run()
    assert ran == [1] and calls == [], "no profiler, no error: the label must not be formatted"
    assert task.label == "layer0" and task.label == "layer0" and calls == [1]  # formatted once, then kept


def test_a_profiler_sees_each_task_under_its_label():
    calls: list[int] = []
    task = WgradTask(lambda: None, store=WeightGradStore(), label=_counting_label(calls))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        assert profiler_active()
        task.run()
    names = {e.name for e in prof.events()}
    assert "splitgrad.wgrad:layer0" in names and calls == [1], sorted(names)[:20]


def test_a_layer_task_is_labelled_with_the_layer_in_the_profile_and_in_errors():
    layer = splitgrad.Linear(4, 3, delay_wgrad_compute=True)
    x = torch.randn(2, 4, dtype=torch.float64, requires_grad=True)
    layer.double()
    layer(x).sum().backward()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        layer.backward_dw()
    wgrad = [e.name for e in prof.events() if e.name.startswith("splitgrad.wgrad:")]
    assert len(wgrad) == 1 and "Linear" in wgrad[0], wgrad
    # The same name in an error: the task's saved input changed in place after backward.
    layer(x).sum().backward()
    with torch.no_grad():
        x.add_(1.0)
    try:
        layer.backward_dw()
    except RuntimeError as exc:
        assert wgrad[0].removeprefix("splitgrad.wgrad:") in str(exc), (wgrad, str(exc))
    else:
        raise AssertionError("an input modified in place after backward must be refused")
    splitgrad.discard_wgrad(layer)
