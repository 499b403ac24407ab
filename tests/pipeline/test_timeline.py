"""Timeline pictures: the ASCII grid, Chrome-trace JSON and the PNG Gantt chart, from simulated events and
from hand-made "measured" events (the runtime will feed the same renderer).

Why: these are how people read schedules and runtime traces; the grid is also used in error messages and
golden files, so its layout is pinned down exactly.
"""

from __future__ import annotations

import json

import pytest

from splitgrad.pipeline import Action, ActionKind, build_schedule, simulate
from splitgrad.pipeline.timeline import TimelineEvent, render_ascii, to_chrome_trace, write_chrome_trace

F, B, W = ActionKind.F, ActionKind.B, ActionKind.W


def test_ascii_grid_of_1f1b_is_exact():
    text = simulate(build_schedule("1f1b", 2, 3, split_backward=True)).to_ascii()
    assert text.splitlines() == [
        "r0  | F0 F1 .  B0 W0 F2 B1 W1 .  B2 W2",
        "r1  | .  F0 B0 W0 F1 B1 W1 F2 B2 W2 .",
    ]


def test_ascii_continuation_and_full_names():
    result = simulate(build_schedule("zbv", 4, 2), f=1, b=2, w=1)
    lines = result.to_ascii().splitlines()
    assert lines[0].startswith("r0  | 0F0 0F1 ")
    assert " -   " in lines[0]  # a 2-unit B continues over a second column
    assert "3B0" in lines[0]


def test_ascii_cut_to_max_columns():
    text = simulate(build_schedule("gpipe", 2, 30)).to_ascii(max_columns=10)
    assert all(line.endswith("...") for line in text.splitlines())


def test_measured_events_render():
    """Events as a runtime would record them: uneven times, a comm event, and a non-compute tag."""
    events = [
        TimelineEvent.from_action(0, Action(0, F, 0), 0.000, 0.010),
        TimelineEvent.from_action(1, Action(1, F, 0), 0.012, 0.021),
        TimelineEvent(1, "recv act 1F0", 0.010, 0.012, "comm"),
        TimelineEvent.from_action(1, Action(1, B, 0), 0.021, 0.030),
        TimelineEvent.from_action(0, Action(0, B, 0), 0.032, 0.041),
        TimelineEvent.from_action(0, Action(0, W, 0), 0.041, 0.050),
        TimelineEvent(0, "optimizer", 0.050, 0.055, "optim"),
    ]
    grid = render_ascii(events, unit=0.01, compact=True)
    assert grid.splitlines()[0].startswith("r0  | F0")
    trace = to_chrome_trace(events, us_per_unit=1e6)
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(spans) == len(events)
    comm = next(e for e in spans if e["cat"] == "comm")
    assert (
        comm["tid"] == 3 and comm["ts"] == pytest.approx(10_000.0) and comm["dur"] == pytest.approx(2_000.0)
    )
    f0 = next(e for e in spans if e["name"] == "0F0")
    assert f0["tid"] == 0 and f0["args"] == {"kind": "F", "stage": 0, "microbatch": 0}
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert names == {"rank 0", "rank 0 comm", "rank 1", "rank 1 comm"}


def test_chrome_trace_file(tmp_path):
    result = simulate(build_schedule("zb-h1", 3, 4), comm=0.1)
    path = write_chrome_trace(result.events(), tmp_path / "trace.json")
    data = json.loads(path.read_text())
    assert sum(1 for e in data["traceEvents"] if e["ph"] == "X" and e["cat"] != "comm") == 36


def test_png_gantt(tmp_path):
    pytest.importorskip("matplotlib")
    result = simulate(build_schedule("zb-h1", 4, 8))
    path = result.save_png(tmp_path / "zb-h1.png")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    assert "bubble 11.1%" in result.title()
    # Several stages per rank and comm events draw too.
    simulate(build_schedule("zbv", 8, 8), comm=0.2).save_png(tmp_path / "zbv.png")
    assert (tmp_path / "zbv.png").stat().st_size > 10_000


def test_bad_events_raise():
    with pytest.raises(ValueError, match="start <= end"):
        render_ascii([TimelineEvent(0, "x", 2.0, 1.0, "F")])
    with pytest.raises(ValueError, match="rank 3"):
        render_ascii([TimelineEvent(3, "x", 0.0, 1.0, "F")], n_ranks=2)
    with pytest.raises(ValueError, match="unit must be > 0"):
        render_ascii([TimelineEvent(0, "x", 0.0, 1.0, "F")], unit=0.0)
