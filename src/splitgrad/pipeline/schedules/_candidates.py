"""The candidate pool shared by the cost-aware searches (zb-auto, zbv-auto).

Both searches build many schedules, simulate each under the user's costs and memory model, drop those over
the memory limit and return the best. That bookkeeping lives here once; each search only decides which
schedules to build.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import NamedTuple

from ..ir.actions import Schedule
from ..ir.simulate import SimulationResult
from ._list_scheduler import PlanCosts

__all__ = ["Candidate", "CandidatePool"]

logger = logging.getLogger(__name__)

_EPS = 1e-9


class Candidate(NamedTuple):
    """One schedule a search considered, with its simulation under the requested costs."""

    label: str
    schedule: Schedule
    result: SimulationResult


def rank_key(c: Candidate) -> tuple[float, float, float]:
    """Shortest longest-rank span, then shortest makespan, then lower peak memory (rounded: float noise
    never decides)."""
    spans = [hi - lo for lo, hi in c.result.rank_spans]
    return (round(max(spans), 9), round(c.result.makespan, 9), max(c.result.peak_memory))


def spans_key(c: Candidate) -> tuple[float, ...]:
    """Every rank's span, longest first: a finer order than :func:`rank_key` for local searches, where a
    change that shortens the second-longest rank is progress too."""
    return tuple(sorted((round(hi - lo, 9) for lo, hi in c.result.rank_spans), reverse=True))


class CandidatePool:
    """Schedules simulated under one set of costs, kept when they fit the per-rank memory limits.

    Args:
        costs: the search's costs and memory model (a :class:`~._search.GreedySearch` runs its passes under
            them too).
        limits: per-rank memory limit in units of ``M_B``.
    """

    def __init__(self, costs: PlanCosts, limits: Sequence[float]) -> None:
        self.costs = costs
        self.limits = tuple(limits)
        self.candidates: list[Candidate] = []

    def consider(self, label: str, schedule: Schedule | None) -> Candidate | None:
        """Simulate ``schedule`` (None: a pass that stalled) and keep it if every rank's peak memory (units
        of ``M_B``) is within its limit; the kept candidate, else None."""
        if schedule is None:
            return None
        result = self.costs.simulate(schedule)
        if any(peak > cap + _EPS for peak, cap in zip(result.peak_memory, self.limits)):
            return None
        self.candidates.append(Candidate(label, schedule, result))
        return self.candidates[-1]

    def ranked(self) -> list[Candidate]:
        """The kept candidates, best first (:func:`rank_key`; ties keep the order they were considered in)."""
        self.candidates.sort(key=rank_key)
        return self.candidates


def pick_best(candidates: list[Candidate], what: str, error: str) -> Schedule:
    """The first (best) candidate's schedule, logged; ``ValueError(error)`` when there is none.

    Args:
        candidates: ranked candidates (best first).
        what: the search's name for the log line.
        error: the message when no candidate fits.
    """
    if not candidates:
        raise ValueError(error)
    best = candidates[0]
    logger.info("%s picked %s (bubble %.4f)", what, best.label, best.result.bubble_ratio)
    return best.schedule
