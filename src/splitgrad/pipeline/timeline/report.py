"""Reports of a measured step: the one-line bubble comparison and the trace/Gantt files.

What :meth:`PipelineRuntime.timeline_report <splitgrad.pipeline.runtime.PipelineRuntime.timeline_report>`
prints and writes, once the ranks' events are gathered; torch-free, so a saved timeline can be reported on
anywhere.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

from ..ir.actions import Schedule
from ..ir.simulate import simulate
from .analysis import measured_bubble_ratio, simulate_measured
from .events import TimelineEvent
from .render import save_png, write_chrome_trace
from .replay import replay_measured

__all__ = ["bubble_report", "save_measured_timeline", "timeline_report"]

logger = logging.getLogger(__name__)


def bubble_report(events: Sequence[TimelineEvent], schedule: Schedule) -> str:
    """One line: the measured bubble ratio next to the simulated ones (measured per-stage costs, unit costs)
    and the replay at each action's own duration (:func:`~splitgrad.pipeline.timeline.replay.replay_measured`)."""
    measured = measured_bubble_ratio(events)
    at_costs = simulate_measured(events, schedule).bubble_ratio
    unit = simulate(schedule).bubble_ratio
    try:
        replayed = f", {100 * replay_measured(events, schedule).bubble_ratio:.1f}% replayed at each action's own duration"
    except ValueError:  # events of another schedule (e.g. the step before a planner installed its plan)
        replayed = ""
    span = max(e.end for e in events if e.is_compute) - min(e.start for e in events if e.is_compute)
    return (
        f"{schedule.name}: {schedule.n_stages} stages on {schedule.n_ranks} ranks, {schedule.n_microbatches} "
        f"microbatches, step {1e3 * span:.1f} ms: measured bubble {100 * measured:.1f}%, simulated "
        f"{100 * at_costs:.1f}% at the measured per-stage costs ({100 * unit:.1f}% at unit costs){replayed}"
    )


def save_measured_timeline(
    events: Sequence[TimelineEvent], schedule: Schedule, prefix: str | Path
) -> tuple[Path, Path | None]:
    """Write ``<prefix>.json`` (Chrome trace / Perfetto) and, when matplotlib is installed, ``<prefix>.png``.

    Returns:
        The two paths (the PNG's is None without matplotlib).
    """
    prefix = Path(prefix)
    trace = write_chrome_trace(
        events, prefix.with_suffix(".json"), us_per_unit=1e6, process_name=schedule.name
    )
    try:
        png = save_png(
            events,
            prefix.with_suffix(".png"),
            title=bubble_report(events, schedule),
            n_ranks=schedule.n_ranks,
            time_label="seconds",
        )
    except ImportError:
        logger.info("matplotlib is not installed: wrote %s only", trace)
        png = None
    return trace, png


def timeline_report(
    events: Sequence[TimelineEvent],
    schedule: Schedule,
    prefix: str | Path | None = None,
    *,
    predicted_bubble: float | None = None,
) -> str:
    """The bubble line of one measured step (:func:`bubble_report`) and, with ``prefix``, its files.

    Args:
        events: every rank's events of the step, in seconds.
        schedule: the schedule the step ran.
        prefix: write ``<prefix>.json`` (Perfetto) and ``<prefix>.png`` (Gantt) too.
        predicted_bubble: the bubble ratio a planner predicted for ``schedule``, appended to the line.

    Raises:
        ValueError: no compute events (the runtime did not record a timeline).
    """
    if not any(e.is_compute for e in events):
        raise ValueError("timeline_report: the step recorded no events (record_timeline=False?)")
    if prefix is not None:
        save_measured_timeline(events, schedule, prefix)
    report = bubble_report(events, schedule)
    if predicted_bubble is not None:
        report += f"; planned {100 * predicted_bubble:.1f}% from the profiled costs"
    return report
