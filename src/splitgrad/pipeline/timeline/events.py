"""The timed event every timeline is drawn from: one interval on one rank, simulated or measured.

:meth:`SimulationResult.events <splitgrad.pipeline.ir.simulate.SimulationResult.events>` makes them from a
schedule and the costs; a runtime makes them from measured timestamps (:meth:`TimelineEvent.from_action`); the
renderers (:mod:`~splitgrad.pipeline.timeline.render`) and the measured-vs-simulated analysis read them alike.
"""

from __future__ import annotations

from typing import NamedTuple

from ..ir.actions import Action, OverlapAction

__all__ = ["COMPUTE_KINDS", "TimelineEvent"]

COMPUTE_KINDS = ("F", "B", "W", "BW", "FB")
"""Event kinds drawn as compute; everything else is drawn on the side track."""


class TimelineEvent(NamedTuple):
    """One timed interval on one rank.

    ``start``/``end`` are in any unit (simulated cost units, or seconds for measured runs).
    """

    rank: int
    name: str
    """Label, e.g. ``"1F0"`` for an action or ``"recv grad 1B0"`` for communication."""
    start: float
    end: float
    kind: str
    """``"F"``, ``"B"``, ``"W"``, ``"BW"`` for compute, ``"comm"`` for transfers, or any other tag."""
    stage: int | None = None
    microbatch: int | None = None

    @classmethod
    def from_action(
        cls, rank: int, action: Action | OverlapAction, start: float, end: float
    ) -> TimelineEvent:
        """Event for ``action`` run on ``rank`` over ``[start, end)`` (an overlapped pair: kind ``"FB"``, stage
        of its forward part, no microbatch)."""
        return cls(rank, action.name, start, end, action.kind.value, action.stage, action.microbatch)

    @property
    def is_compute(self) -> bool:
        """Whether the event is one of the compute kinds."""
        return self.kind in COMPUTE_KINDS
