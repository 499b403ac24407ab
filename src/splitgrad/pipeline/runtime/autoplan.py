"""Profile-guided schedules: measure a pipeline's real costs on warm-up steps, then plan ``zb-auto`` with them.

:func:`~splitgrad.pipeline.build_runtime` with ``schedule="zb-auto"`` (or ``"auto"``) and no costs given starts
the runtime on 1F1B with split backward (exact gradients, every ``F``/``B``/``W`` timed separately) and attaches
a :class:`ProfileGuidedPlanner`. After ``profile_steps`` steps it gathers from every pipeline rank the median
``F``, ``B``, ``W`` time of its stage, the shortest receive wait (the point-to-point latency without waiting
for a producer) and the bytes one microbatch keeps from ``F`` to ``B`` (``M_B``) and from ``B`` to ``W`` (the
bundle's operands, ``M_W``); plans :func:`~splitgrad.pipeline.schedules.zb_auto` with those costs, ``w_memory = M_W /
M_B`` and the memory budget; and installs the plan on every rank (:meth:`PipelineRuntime.install_schedule`).
:attr:`ProfileGuidedPlanner.plan` records what was measured, the plan and its predicted bubble, to compare
with the measured one (:meth:`PipelineRuntime.timeline_report`).
"""

from __future__ import annotations

import logging
import statistics
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from ..ir.actions import Schedule
from ..ir.simulate import simulate
from ..schedules import zb_auto
from ..timeline.analysis import measured_costs

__all__ = ["AutoPlan", "ProfileGuidedPlanner", "profiling_schedule"]

logger = logging.getLogger(__name__)


def profiling_schedule(n_stages: int, n_microbatches: int) -> Schedule:
    """The schedule profile steps run: 1F1B with split backward (``F``, ``B``, ``W`` each timed)."""
    from ..schedules import one_f_one_b

    return one_f_one_b(n_stages, n_microbatches, split_backward=True)


@dataclass(frozen=True, slots=True)
class AutoPlan:
    """What a profile-guided runtime measured and what it planned from it (seconds and bytes)."""

    f: tuple[float, ...]
    """Median forward time per stage."""
    b: tuple[float, ...]
    """Median input-gradient time per stage."""
    w: tuple[float, ...]
    """Median weight-gradient time per stage."""
    comm: float
    """Shortest receive wait seen (point-to-point latency)."""
    activation_bytes: tuple[int, ...]
    """``M_B`` per stage: bytes one microbatch's forward saves until its ``B``."""
    wgrad_bytes: tuple[int, ...]
    """``M_W`` per stage: bytes its bundle keeps from ``B`` to ``W``."""
    w_memory: float
    """``max(M_W / M_B)`` over the stages, the ratio zb-auto planned with."""
    memory_limit: tuple[float, ...]
    """Per-rank limit in units of that rank's ``M_B``."""
    schedule: Schedule
    """The installed plan."""
    predicted_bubble: float
    """The plan's simulated bubble ratio at the measured costs."""

    def describe(self) -> str:
        """One line for logs and the demo."""
        ms = ", ".join(
            f"{1e3 * f:.1f}/{1e3 * b:.1f}/{1e3 * w:.1f}" for f, b, w in zip(self.f, self.b, self.w)
        )
        return (
            f"zb-auto planned from profiled costs (F/B/W ms per stage: {ms}; P2P {1e3 * self.comm:.2f} ms; "
            f"M_W/M_B {self.w_memory:.2f}; memory limit {max(self.memory_limit):.1f} activations): predicted "
            f"bubble {100 * self.predicted_bubble:.1f}%"
        )


class ProfileGuidedPlanner:
    """Plans ``zb-auto`` from the costs the first ``profile_steps`` steps measured (see the module docstring).

    Args:
        memory_budget: activation memory per rank in 1F1B-equivalents (``1.0``: 1F1B's peak, ``p``
            activations on rank 0; ``2.0``: the paper's ZB-2p budget). Default 1.0.
        memory_budget_bytes: or in bytes of activations per rank (divided by that rank's measured ``M_B``).
        profile_steps: steps to measure before planning (>= 1).
    """

    def __init__(
        self,
        *,
        memory_budget: float | None = None,
        memory_budget_bytes: int | None = None,
        profile_steps: int = 1,
    ) -> None:
        if memory_budget is not None and memory_budget_bytes is not None:
            raise ValueError(
                "zb-auto: give memory_budget (1F1B-equivalents) or memory_budget_bytes, not both"
            )
        if memory_budget is not None and not float(memory_budget) > 0:
            raise ValueError(f"zb-auto: memory_budget must be > 0 (1F1B-equivalents), got {memory_budget=}")
        if memory_budget_bytes is not None and not int(memory_budget_bytes) > 0:
            raise ValueError(f"zb-auto: memory_budget_bytes must be > 0, got {memory_budget_bytes=}")
        if isinstance(profile_steps, bool) or not isinstance(profile_steps, int) or profile_steps < 1:
            raise ValueError(f"zb-auto: profile_steps must be an integer >= 1, got {profile_steps=}")
        self.memory_budget = None if memory_budget is None else float(memory_budget)
        self.memory_budget_bytes = None if memory_budget_bytes is None else int(memory_budget_bytes)
        self.profile_steps = profile_steps
        self.events: list[Any] = []
        self.steps = 0
        #: Keep activation metering after planning (the user asked for ``track_memory``).
        self.keep_meter = False
        #: Set once the plan is installed.
        self.plan: AutoPlan | None = None

    def observe(self, runtime: Any, result: Any) -> None:
        """Called by the runtime after each step: collect, and plan after the last profile step."""
        if self.plan is not None:
            return
        self.events += result.events
        self.steps += 1
        if self.steps < self.profile_steps:
            return
        self.plan = self._plan(runtime)
        self.events = []
        runtime.install_schedule(self.plan.schedule)
        if not self.keep_meter:
            runtime.executor.meter = None
        logger.info("pipeline rank %d: %s", runtime.rank, self.plan.describe())

    def _plan(self, runtime: Any) -> AutoPlan:
        sched: Schedule = runtime.schedule
        p, m = sched.n_ranks, sched.n_microbatches
        f, b, w, _ = measured_costs(self.events, sched.n_stages)
        waits = [e.end - e.start for e in self.events if e.kind == "comm"]
        meter = runtime.executor.meter
        mine = {
            s: (
                int(statistics.median(meter.forward_bytes.get(s, [0]))),
                int(statistics.median(meter.held_bytes.get(s, [0]))),
            )
            for s in runtime.stages
        }
        meter.clear_samples()
        local = {
            "f": {s: f[s] for s in runtime.stages},
            "b": {s: b[s] for s in runtime.stages},
            "w": {s: w[s] for s in runtime.stages},
            "bytes": mine,
            "comm": min(waits) if waits else 0.0,
        }
        gathered = [local]
        if runtime.comm is not None:  # a multi-rank pipeline
            gathered = [None] * p
            dist.all_gather_object(gathered, local, group=runtime.pp_group)
        fc, bc, wc, mb, mw = [0.0] * p, [0.0] * p, [0.0] * p, [0] * p, [0] * p
        for part in gathered:
            for s in part["f"]:
                fc[s], bc[s], wc[s] = part["f"][s], part["b"][s], part["w"][s]
                mb[s], mw[s] = part["bytes"][s]
        comm = statistics.median(part["comm"] for part in gathered)
        ratios = [mw[s] / mb[s] for s in range(p) if mb[s] > 0]
        w_memory = min(1.0, max(ratios)) if ratios else 1.0
        if self.memory_budget_bytes is not None:
            limits = tuple(
                max(1.0, self.memory_budget_bytes / mb[s]) if mb[s] else float(p) for s in range(p)
            )
        else:
            limits = (p * (1.0 if self.memory_budget is None else self.memory_budget),) * p
        limits = tuple(max(1.0, x) for x in limits)
        schedule = zb_auto(p, m, f=fc, b=bc, w=wc, comm=comm, memory_limit=limits, w_memory=w_memory)
        predicted = simulate(schedule, fc, bc, wc, comm).bubble_ratio
        return AutoPlan(
            f=tuple(fc),
            b=tuple(bc),
            w=tuple(wc),
            comm=comm,
            activation_bytes=tuple(mb),
            wgrad_bytes=tuple(mw),
            w_memory=w_memory,
            memory_limit=limits,
            schedule=schedule,
            predicted_bubble=predicted,
        )
