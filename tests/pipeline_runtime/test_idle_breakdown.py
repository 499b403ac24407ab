"""idle_breakdown: a measured step's span split into compute, receive waits and unexplained idle time.

Why: closing the gap between the measured and the simulated bubble needs to know whether ranks wait for
messages (latency, late producers) or lose time between actions (send posting, headers, Python); the split
must add up to the span and count overlapping receive waits once.
"""

from __future__ import annotations

import pytest

from splitgrad.pipeline.timeline import TimelineEvent, idle_breakdown


def test_span_splits_into_compute_waits_and_the_rest():
    events = [
        TimelineEvent(0, "0F0", 0.0, 1.0, "F", 0, 0),
        TimelineEvent(0, "recv grad 0B0", 1.0, 1.5, "comm"),
        TimelineEvent(0, "recv grad 0B0 (prefetch)", 1.25, 1.75, "comm"),  # overlaps: counted once
        TimelineEvent(0, "0B0", 2.0, 3.0, "B", 0, 0),
        TimelineEvent(0, "0W0", 3.0, 3.5, "W", 0, 0),
        TimelineEvent(0, "recv act after the step", 4.0, 5.0, "comm"),  # outside the span: ignored
        TimelineEvent(1, "1F0", 0.5, 1.5, "F", 1, 0),
        TimelineEvent(1, "1B0", 1.5, 2.5, "B", 1, 0),
    ]
    out = idle_breakdown(events)
    assert out[0] == pytest.approx({"span": 3.5, "compute": 2.5, "recv_wait": 0.75, "other": 0.25})
    assert out[1] == pytest.approx({"span": 2.0, "compute": 2.0, "recv_wait": 0.0, "other": 0.0})
    for parts in out.values():
        assert parts["compute"] + parts["recv_wait"] + parts["other"] == pytest.approx(parts["span"])
    # Not trivially passing: without the waits the same gap is all "other".
    no_waits = idle_breakdown([e for e in events if e.kind != "comm"])
    assert no_waits[0]["recv_wait"] == 0.0 and no_waits[0]["other"] == pytest.approx(1.0)
