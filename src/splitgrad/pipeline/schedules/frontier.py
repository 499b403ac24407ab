"""The memory-bubble frontier: every schedule family's (peak activation memory, bubble) for one model and
pipeline, and the Pareto front among them.

A user choosing a schedule trades activation memory for bubble. :func:`frontier` builds every family that
applies to ``p`` ranks and ``m`` microbatches, simulates it with the same costs and memory model, and marks the
points no other point beats on both. Costs and memory are given for **one rank's share of the layers** (a 1F1B
stage): a family with ``v`` stages per rank runs stages of ``1 / v`` of that, so its per-stage costs and
activations are divided by ``v``, and every point is in the same units. The cost-aware searches appear at
their default memory and at the memory points the others set (``zb-auto`` at ``2p``, ``zbv-auto`` at V-Half's
and V-Min's peaks), which is where they add a point of their own.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..ir._coerce import as_cost, as_count
from ..ir.simulate import check_w_memory, simulate
from .registry import build_schedule
from .v_half import v_half
from .v_min import v_min
from .zbv_auto import zbv_auto

__all__ = ["Frontier", "FrontierPoint", "frontier"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class FrontierPoint:
    """One schedule on the memory-bubble plane."""

    label: str
    """Family and what sets its point, e.g. ``"zb-auto (2p)"`` (a memory limit of ``2p``)."""
    stages_per_rank: int
    """Model stages each rank holds (2 for the V families and interleaved here)."""
    peak_memory: float
    """The highest rank's peak activation memory: in bytes with ``activation_bytes``, else in units of one
    microbatch's activations of one rank's layers (``M_B`` of a 1F1B stage; 1F1B holds ``p`` of them)."""
    bubble_ratio: float
    """The zero-bubble paper's bubble ratio (:attr:`~splitgrad.pipeline.SimulationResult.bubble_ratio`): idle
    share of the longest rank's span, from its first action; a rank's wait for its first input is not in it."""
    makespan: float
    """Simulated step time, in the costs' unit."""
    step_bubble: float
    """Idle share of the step on every rank: ``1 - m (f + b + w) / makespan`` (the same work per rank in every
    family), so comparable across families whose ranks start at different times. The front uses this. With
    ``overlap > 0`` it may be below 0: overlapped pairs hide part of that work."""
    pareto: bool = False
    """No other point has lower-or-equal memory and step bubble with one of them lower."""


@dataclass(frozen=True, slots=True)
class Frontier:
    """The points of :func:`frontier`, lowest memory first, and what was left out."""

    n_ranks: int
    n_microbatches: int
    costs: tuple[float, float, float, float]
    """``(f, b, w, comm)`` for one rank's layers."""
    w_memory: float
    activation_bytes: float | None
    points: tuple[FrontierPoint, ...]
    skipped: tuple[tuple[str, str], ...] = field(default=())
    """``(label, reason)`` of the families that do not apply (e.g. ``m`` not a multiple of ``p``)."""

    @property
    def pareto(self) -> tuple[FrontierPoint, ...]:
        """The Pareto-optimal points, lowest memory first."""
        return tuple(pt for pt in self.points if pt.pareto)

    @property
    def memory_unit(self) -> str:
        return "bytes" if self.activation_bytes is not None else "M_B (one rank's layers, one microbatch)"

    def to_table(self) -> str:
        """A Markdown table: one row per point, Pareto points marked, then the skipped families."""
        mem = "peak memory (MiB)" if self.activation_bytes is not None else "peak memory (M_B)"
        lines = [
            f"| schedule | stages per rank | {mem} | step bubble | bubble (paper) | makespan | Pareto |",
            "|---|---:|---:|---:|---:|---:|:---:|",
        ]
        for pt in self.points:
            shown = pt.peak_memory / 2**20 if self.activation_bytes is not None else pt.peak_memory
            lines.append(
                f"| {pt.label} | {pt.stages_per_rank} | {shown:.2f} | {pt.step_bubble:.4f} | {pt.bubble_ratio:.4f} | "
                f"{pt.makespan:.6g} | {'yes' if pt.pareto else ''} |"
            )
        lines += [f"\n{label}: skipped ({reason})" for label, reason in self.skipped]
        return "\n".join(lines)

    def save_png(self, path: str | Path, *, dpi: int = 120) -> Path:
        """Scatter plot of the points (memory across, step bubble up) with the Pareto front as a step line.

        Raises:
            ImportError: matplotlib is not installed (``pip install 'splitgrad[plot]'``).
        """
        try:
            from matplotlib.backends.backend_agg import FigureCanvasAgg
            from matplotlib.figure import Figure
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise ImportError("Frontier.save_png needs matplotlib: pip install 'splitgrad[plot]'") from exc
        scale = 2**20 if self.activation_bytes is not None else 1.0
        fig = Figure(figsize=(9.0, 5.5), dpi=dpi)
        FigureCanvasAgg(fig)
        ax = fig.add_subplot(1, 1, 1)
        # Coincident points share one label; labels at the same memory alternate above and below.
        spots: dict[tuple[float, float], list[FrontierPoint]] = {}
        for pt in self.points:
            spots.setdefault((round(pt.peak_memory / scale, 6), round(100 * pt.step_bubble, 6)), []).append(
                pt
            )
        seen_at_memory: dict[float, int] = {}
        for (x, y), group in spots.items():
            pareto = any(pt.pareto for pt in group)
            ax.scatter([x], [y], color="tab:blue" if pareto else "tab:gray", zorder=3)
            k = seen_at_memory[x] = seen_at_memory.get(x, -1) + 1
            label = " = ".join(pt.label for pt in group)
            ax.annotate(
                label, (x, y), textcoords="offset points", xytext=(4, 4 if k % 2 == 0 else -11), fontsize=7
            )
        front = self.pareto
        if front:
            xs = [pt.peak_memory / scale for pt in front]
            ys = [100 * pt.step_bubble for pt in front]
            ax.step(xs, ys, where="post", color="tab:blue", linewidth=1.2, label="Pareto front")
            ax.legend(loc="upper right")
        f, b, w, comm = self.costs
        ax.set_title(
            f"{self.n_ranks} ranks, {self.n_microbatches} microbatches, F={f:g} B={b:g} W={w:g} comm={comm:g}, "
            f"w_memory={self.w_memory:g}",
            fontsize=9,
        )
        ax.set_xlabel("peak activation memory per rank (" + ("MiB" if scale != 1.0 else "M_B") + ")")
        ax.set_ylabel("step bubble (%): idle share of the step")
        ax.grid(True, alpha=0.3)
        fig.tight_layout()
        path = Path(path)
        fig.savefig(path)
        return path


def frontier(
    n_ranks: int,
    n_microbatches: int,
    f: float = 1.0,
    b: float = 1.0,
    w: float = 1.0,
    *,
    comm: float = 0.0,
    activation_bytes: float | None = None,
    w_memory: float = 1.0,
    overlap: float = 0.0,
) -> Frontier:
    """Every family's (peak activation memory, bubble) on ``n_ranks`` ranks, and the Pareto front.

    The front is taken over (peak memory, :attr:`FrontierPoint.step_bubble`): the paper's bubble ratio leaves
    out a rank's wait for its first input, which is small in a V (every rank starts at once) and large in a
    1F1B-placed schedule, so it would put ``zb-auto`` ahead of a V schedule with the shorter step.

    Args:
        n_ranks: pipeline ranks ``p``.
        n_microbatches: microbatches per step ``m``.
        f, b, w: forward, input-gradient and weight-gradient cost of one microbatch on one rank's share of the
            layers (a 1F1B stage); a family with ``v`` stages per rank gets ``f / v`` per stage.
        comm: transfer latency between ranks.
        activation_bytes: activation memory one microbatch holds on one rank's layers (``M_B``, bytes); None
            reports memory in units of ``M_B``.
        w_memory: ``M_W / M_B``, the part of an activation a ``B`` keeps for its ``W`` (the paper's model).
        overlap: fraction of an overlapped ``F+B`` pair's shorter part hidden (``dualpipev``, the combined
            interleaved 1F1B); 0 counts pairs at their sum.

    Returns:
        A :class:`Frontier`.

    Raises:
        ValueError: bad counts or costs (naming the argument).
    """
    p = as_count("frontier: n_ranks", n_ranks)
    m = as_count("frontier: n_microbatches", n_microbatches)
    f, b, w = (as_cost(f"frontier: {k}", v) for k, v in (("f", f), ("b", b), ("w", w)))
    comm = as_cost("frontier: comm", comm)
    overlap = as_cost("frontier: overlap", overlap)
    w_memory = check_w_memory(w_memory, "frontier")
    if activation_bytes is not None:
        activation_bytes = as_cost("frontier: activation_bytes", activation_bytes)
    points: list[FrontierPoint] = []
    skipped: list[tuple[str, str]] = []

    def add(label: str, v: int, build: Any) -> None:
        try:
            schedule = build()
        except ValueError as exc:
            skipped.append((label, str(exc)))
            return
        res = simulate(schedule, f / v, b / v, w / v, comm, overlap=overlap, w_memory=w_memory)
        unit = (activation_bytes if activation_bytes is not None else 1.0) / v
        idle = 1.0 - m * (f + b + w) / res.makespan if res.makespan > 0 else 0.0
        points.append(
            FrontierPoint(label, v, max(res.peak_memory) * unit, res.bubble_ratio, res.makespan, idle)
        )

    costs = {"f": f, "b": b, "w": w, "comm": comm, "w_memory": w_memory}
    v_costs = {"f": f / 2, "b": b / 2, "w": w / 2, "comm": comm, "w_memory": w_memory}
    add("gpipe", 1, lambda: build_schedule("gpipe", p, m))
    add("1f1b", 1, lambda: build_schedule("1f1b", p, m))
    add("interleaved-1f1b", 2, lambda: build_schedule("interleaved-1f1b", 2 * p, m))
    add("interleaved-1f1b (overlap)", 2, lambda: build_schedule("interleaved-1f1b", 2 * p, m, overlap=True))
    add("zb-h1", 1, lambda: build_schedule("zb-h1", p, m))
    add("zb-h2", 1, lambda: build_schedule("zb-h2", p, m))
    add("zb-auto", 1, lambda: build_schedule("zb-auto", p, m, **costs))
    add("zb-auto (2p)", 1, lambda: build_schedule("zb-auto", p, m, **costs, memory_limit=2 * p))
    add("zbv", 2, lambda: build_schedule("zbv", 2 * p, m))
    add("dualpipev", 2, lambda: build_schedule("dualpipev", 2 * p, m))
    add("zbv-auto", 2, lambda: zbv_auto(2 * p, m, **v_costs))
    for name, block in (("v-half", v_half(2 * p, m)), ("v-min", v_min(2 * p, m))):
        add(name, 2, lambda block=block: block)
        # zbv-auto at the block's own peak (in V-stage activations under this memory model).
        limit = max(simulate(block, w_memory=w_memory).peak_memory)
        if limit < 2 * p:
            add(
                f"zbv-auto ({name}'s memory)",
                2,
                lambda x=limit: zbv_auto(2 * p, m, **v_costs, memory_limit=x),
            )
    points = _mark_pareto(points)
    logger.info(
        "frontier p=%d m=%d: %d points, %d on the front", p, m, len(points), sum(x.pareto for x in points)
    )
    return Frontier(p, m, (f, b, w, comm), w_memory, activation_bytes, tuple(points), tuple(skipped))


def _mark_pareto(points: Sequence[FrontierPoint]) -> list[FrontierPoint]:
    """``points`` sorted by (memory, step bubble) with :attr:`FrontierPoint.pareto` set (ties in both are kept)."""
    out = []
    for pt in sorted(points, key=lambda x: (round(x.peak_memory, 9), round(x.step_bubble, 12), x.label)):
        dominated = any(
            o.peak_memory <= pt.peak_memory + 1e-12
            and o.step_bubble <= pt.step_bubble + 1e-12
            and (o.peak_memory < pt.peak_memory - 1e-12 or o.step_bubble < pt.step_bubble - 1e-12)
            for o in points
        )
        out.append(dataclasses.replace(pt, pareto=not dominated))
    return out
