"""Pictures of timed events per rank: ASCII grid, Chrome-trace/Perfetto JSON, PNG Gantt.

The input is deliberately generic: a list of :class:`~.events.TimelineEvent` ``(rank, name, start, end, kind,
...)``, from the simulator or a measured run alike. Kinds ``"F"``, ``"B"``, ``"W"``, ``"BW"`` and ``"FB"`` (an
overlapped forward+backward pair) are compute; ``"comm"``, the gradient-sync points ``"R"``/``"RF"`` (or any
other kind) are drawn on a thin side track. matplotlib is imported only inside :func:`save_png`.
"""

from __future__ import annotations

import json
import logging
import math
import textwrap
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from .events import COMPUTE_KINDS, TimelineEvent

__all__ = [
    "render_ascii",
    "save_png",
    "to_chrome_trace",
    "write_chrome_trace",
]

logger = logging.getLogger(__name__)

# Paper-like palette: forward blue, input gradient teal, weight gradient green, full backward orange.
_COLOURS = {"F": "#4f7fd9", "B": "#33b5b5", "W": "#7cc456", "BW": "#ee9a45", "FB": "#a77bd6"}
_OTHER_COLOUR = "#9a9a9a"


def _check_events(events: Sequence[TimelineEvent]) -> None:
    bad = [e for e in events if not (math.isfinite(e.start) and math.isfinite(e.end)) or e.end < e.start]
    if bad:
        raise ValueError(f"timeline events need finite start <= end, got e.g. {bad[0]}")


def _rank_count(events: Sequence[TimelineEvent], n_ranks: int | None) -> int:
    seen = 1 + max((e.rank for e in events), default=-1)
    if n_ranks is None:
        return seen
    if seen > n_ranks:
        raise ValueError(f"events mention rank {seen - 1} but {n_ranks=}")
    return n_ranks


def render_ascii(
    events: Iterable[TimelineEvent],
    *,
    n_ranks: int | None = None,
    unit: float | None = None,
    compact: bool = False,
    max_columns: int = 400,
) -> str:
    """Time-aligned grid, one row per rank, one column per ``unit`` of time.

    A compute event prints its label in its first column and ``-`` in the columns it continues over; idle
    columns print ``.``. Non-compute events are left out.

    Args:
        events: timed events (e.g. ``simulate(...).events()``).
        n_ranks: number of rows (default: highest rank seen + 1).
        unit: time per column (default: the shortest compute event).
        compact: label with kind and microbatch only (``"F3"``), for one stage per rank; otherwise the full
            action name (``"1F3"``).
        max_columns: columns beyond this are cut and marked ``...``.

    Returns:
        The grid as a string (no trailing newline).
    """
    compute = [e for e in events if e.is_compute]
    _check_events(compute)
    rows = _rank_count(compute, n_ranks)
    if not compute:
        return "\n".join(f"r{r:<3}|" for r in range(rows))
    if unit is None:
        positive = [e.end - e.start for e in compute if e.end > e.start]
        unit = min(positive) if positive else 1.0
    if unit <= 0:
        raise ValueError(f"unit must be > 0, got {unit=}")
    t0 = min(e.start for e in compute)

    def col(t: float) -> int:
        return round((t - t0) / unit)

    n_cols = max(col(e.end) for e in compute)
    shown = min(n_cols, max_columns)

    def label(e: TimelineEvent) -> str:
        if compact and e.microbatch is not None:
            return f"{e.kind}{e.microbatch}"
        return e.name

    width = max(len(label(e)) for e in compute)
    grid = [["."] * shown for _ in range(rows)]
    for e in compute:
        first, stop = col(e.start), max(col(e.start) + 1, col(e.end))
        for c in range(first, min(stop, shown)):
            grid[e.rank][c] = label(e) if c == first else "-"
    tail = " ..." if n_cols > shown else ""
    return "\n".join(
        f"r{r:<3}| " + " ".join(cell.ljust(width) for cell in grid[r]).rstrip() + tail for r in range(rows)
    )


def to_chrome_trace(
    events: Iterable[TimelineEvent],
    *,
    us_per_unit: float = 1.0,
    process_name: str = "splitgrad pipeline",
) -> dict[str, Any]:
    """Chrome-trace JSON object (opens in Perfetto / ``chrome://tracing``).

    Each rank is a thread ``rank r``; non-compute events go to a second thread ``rank r comm``.

    Args:
        events: timed events.
        us_per_unit: microseconds per event time unit (``1e6`` for events in seconds).
        process_name: name shown for the single process.
    """
    events = list(events)
    _check_events(events)
    trace: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "pid": 0, "tid": 0, "args": {"name": process_name}}
    ]
    ranks = sorted({e.rank for e in events})
    for r in ranks:
        for tid, suffix in ((2 * r, ""), (2 * r + 1, " comm")):
            trace.append(
                {
                    "name": "thread_name",
                    "ph": "M",
                    "pid": 0,
                    "tid": tid,
                    "args": {"name": f"rank {r}{suffix}"},
                }
            )
            trace.append(
                {"name": "thread_sort_index", "ph": "M", "pid": 0, "tid": tid, "args": {"sort_index": tid}}
            )
    for e in events:
        args: dict[str, Any] = {"kind": e.kind}
        if e.stage is not None:
            args["stage"] = e.stage
        if e.microbatch is not None:
            args["microbatch"] = e.microbatch
        trace.append(
            {
                "name": e.name,
                "cat": e.kind,
                "ph": "X",
                "pid": 0,
                "tid": 2 * e.rank + (0 if e.is_compute else 1),
                "ts": e.start * us_per_unit,
                "dur": (e.end - e.start) * us_per_unit,
                "args": args,
            }
        )
    return {"traceEvents": trace, "displayTimeUnit": "ms"}


def write_chrome_trace(events: Iterable[TimelineEvent], path: str | Path, **kwargs: Any) -> Path:
    """Write :func:`to_chrome_trace` output to ``path`` as JSON; returns the path."""
    path = Path(path)
    path.write_text(json.dumps(to_chrome_trace(events, **kwargs)))
    return path


def _lighter(colour: str, amount: float) -> str:
    """Blend a ``#rrggbb`` colour towards white."""
    rgb = [int(colour[i : i + 2], 16) for i in (1, 3, 5)]
    return "#" + "".join(f"{round(c + (255 - c) * amount):02x}" for c in rgb)


def save_png(
    events: Iterable[TimelineEvent],
    path: str | Path,
    *,
    title: str | None = None,
    n_ranks: int | None = None,
    dpi: int = 120,
    time_label: str = "time",
) -> Path:
    """Draw a Gantt chart: one row per rank (rank 0 on top), F/B/W/BW coloured, microbatch numbers in bars.

    When a rank holds several stages, its later stages are drawn in a lighter shade of the same colour.
    Non-compute events (communication) are drawn as thin grey bars under their rank's row.

    Args:
        events: timed events (simulated or measured).
        path: output file (PNG).
        title: chart title, e.g. :meth:`SimulationResult.title` (it carries the bubble ratio).
        n_ranks: number of rows (default: highest rank seen + 1).
        dpi: resolution.
        time_label: x-axis label.

    Raises:
        ImportError: matplotlib is not installed (``pip install splitgrad[plot]``).
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("save_png needs matplotlib: pip install 'splitgrad[plot]'") from exc

    events = list(events)
    _check_events(events)
    rows = _rank_count(events, n_ranks)
    compute = [e for e in events if e.is_compute]
    t0 = min((e.start for e in events), default=0.0)
    t1 = max((e.end for e in events), default=1.0)
    total = max(t1 - t0, 1e-12)
    positive = sorted(e.end - e.start for e in compute if e.end > e.start)
    # Scale by the median action, not the shortest: measured timelines have sub-millisecond outliers that
    # would otherwise stretch the chart to its maximum width.
    typical = positive[len(positive) // 2] if positive else total
    width_in = min(48.0, max(8.0, 0.32 * total / typical + 1.5))
    height_in = min(40.0, 1.4 + 0.42 * rows)
    fig = Figure(figsize=(width_in, height_in), dpi=dpi)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)

    # Ordinal of each stage on its rank, to shade a rank's second (third, ...) stage lighter.
    stages_by_rank: dict[int, list[int]] = {}
    for e in compute:
        if e.stage is not None and e.stage not in stages_by_rank.setdefault(e.rank, []):
            stages_by_rank[e.rank].append(e.stage)
    ordinal = {(r, s): sorted(ss).index(s) for r, ss in stages_by_rank.items() for s in ss}

    # One broken_barh collection per (colour, rank): fast even for 10^5 events, unlike one patch per bar.
    groups: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for e in compute:
        shade = ordinal.get((e.rank, e.stage), 0)
        colour = _COLOURS[e.kind] if shade == 0 else _lighter(_COLOURS[e.kind], min(0.6, 0.45 * shade))
        groups.setdefault((colour, e.rank), []).append((e.start - t0, e.end - e.start))
    edge = 0.4 if len(compute) < 5000 else 0.0
    for (colour, rank), ranges in groups.items():
        ax.broken_barh(ranges, (rank - 0.4, 0.8), facecolors=colour, edgecolor="black", linewidth=edge)
    side = [e for e in events if not e.is_compute]
    if side:
        ax.barh(
            [e.rank + 0.47 for e in side],
            [e.end - e.start for e in side],
            left=[e.start - t0 for e in side],
            height=0.12,
            color=_OTHER_COLOUR,
            linewidth=0,
        )

    # Label a bar only when the text fits: ~7 px per character at this font size.
    px_per_unit = width_in * dpi * 0.85 / total
    fontsize = 7 if rows <= 16 else 5
    for e in compute:
        text = str(e.microbatch) if e.microbatch is not None else e.name
        if (e.end - e.start) * px_per_unit >= 6.5 * len(text) * fontsize / 7 + 2:
            ax.text(
                (e.start + e.end) / 2 - t0,
                e.rank,
                text,
                ha="center",
                va="center",
                fontsize=fontsize,
                color="black",
            )

    ax.set_ylim(rows - 0.5, -0.6)
    ax.set_xlim(0, total)
    ax.set_yticks(range(rows))
    ax.set_yticklabels([f"rank {r}" for r in range(rows)], fontsize=8 if rows <= 16 else 5)
    ax.set_xlabel(time_label)
    if title:
        # Wrap to the axes width (~10 px per character at 10 pt) so long measured titles stay readable.
        ax.set_title(textwrap.fill(title, max(40, int(width_in * dpi * 0.8 / 10))), fontsize=10)
    kinds = [k for k in COMPUTE_KINDS if any(e.kind == k for e in compute)]
    handles = [Patch(facecolor=_COLOURS[k], edgecolor="black", label=k) for k in kinds]
    if side:
        handles.append(Patch(facecolor=_OTHER_COLOUR, label="comm"))
    if handles:
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=dpi)
    logger.info("wrote pipeline timeline PNG to %s", path)
    return path
