"""Timelines: timed events per rank, their pictures, and measured runs read against the simulator.

Torch-free, like the schedule IR: the renderers (:mod:`~.render`), the replay of a measured step through the
simulator's engine (:mod:`~.replay`), the measured bubble ratio, idle breakdown and per-stage costs
(:mod:`~.analysis`) and the one-line report with its trace files (:mod:`~.report`) all take
:class:`TimelineEvent`\\ s, simulated or measured. Recording them on a running pipeline is the runtime's part
(:mod:`splitgrad.pipeline.runtime.recording`).
"""

from __future__ import annotations

from .analysis import idle_breakdown, measured_bubble_ratio, measured_costs, simulate_measured
from .events import COMPUTE_KINDS, TimelineEvent
from .render import render_ascii, save_png, to_chrome_trace, write_chrome_trace
from .replay import RankOverhead, ReplayResult, overhead_split, replay_measured
from .report import bubble_report, save_measured_timeline, timeline_report

__all__ = [
    "COMPUTE_KINDS",
    "RankOverhead",
    "ReplayResult",
    "TimelineEvent",
    "bubble_report",
    "idle_breakdown",
    "measured_bubble_ratio",
    "measured_costs",
    "overhead_split",
    "render_ascii",
    "replay_measured",
    "save_measured_timeline",
    "save_png",
    "simulate_measured",
    "timeline_report",
    "to_chrome_trace",
    "write_chrome_trace",
]
