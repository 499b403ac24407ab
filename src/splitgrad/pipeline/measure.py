"""Public path of the measurement tools: ``splitgrad.pipeline.measure`` as documented before issue 24.

Issue 24 split the module along the torch line: what reads measured events (bubble ratio, idle breakdown,
per-stage costs, the report and its trace files) lives in :mod:`splitgrad.pipeline.timeline` and imports no
torch; what records them on a running pipeline (:class:`TimelineRecorder`, :class:`ActivationMeter`,
:func:`gather_events`) lives in :mod:`splitgrad.pipeline.runtime.recording`. This alias keeps every name the
module had working from here (it imports torch, as the module did). New code imports from the two homes.
"""

from __future__ import annotations

from ..core.profiling import profiler_active
from .runtime.recording import ActivationMeter, TimelineRecorder, gather_events
from .timeline import (
    bubble_report,
    idle_breakdown,
    measured_bubble_ratio,
    measured_costs,
    save_measured_timeline,
    simulate_measured,
)

__all__ = [
    "ActivationMeter",
    "TimelineRecorder",
    "bubble_report",
    "gather_events",
    "idle_breakdown",
    "measured_bubble_ratio",
    "measured_costs",
    "profiler_active",
    "save_measured_timeline",
    "simulate_measured",
]
