"""The greedy-pass search shared by the cost-aware planners (zb-auto, zbv-auto).

Both planners run one greedy list-scheduling pass under many settings, each time for the same shape, costs
and memory limits, and keep the passes that fit in a :class:`~._candidates.CandidatePool`. This module binds a
pass to a pool once; each planner only names its settings and adds its own extra candidates to the pool.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from ..ir.actions import Schedule
from ._candidates import Candidate, CandidatePool

__all__ = ["GreedySearch"]


class GreedySearch:
    """One greedy pass run under varying settings, every run considered by ``pool``.

    Args:
        greedy_pass: ``(n_stages, n_microbatches, *, f, b, w, comm, memory_limit, w_memory, **settings)
            -> Schedule | None`` (None: the pass stalled under the limit).
        n_stages: model stages.
        n_microbatches: microbatches.
        pool: the pool the runs join; its costs, per-rank limits and ``w_memory`` are the passes' too.
    """

    def __init__(
        self,
        greedy_pass: Callable[..., Schedule | None],
        n_stages: int,
        n_microbatches: int,
        pool: CandidatePool,
    ) -> None:
        costs = pool.costs
        self.pool = pool
        self.settings: dict[str, dict[str, Any]] = {}  # greedy label -> the settings that made it
        self._pass = functools.partial(
            greedy_pass, n_stages, n_microbatches, f=costs.f, b=costs.b, w=costs.w, comm=costs.comm,
            memory_limit=pool.limits, w_memory=costs.w_memory,
        )  # fmt: skip

    def greedy(self, label: str, **settings: Any) -> Candidate | None:
        """Run the pass with ``settings`` and consider it as ``label``; the kept candidate, else None."""
        self.settings[label] = settings
        return self.pool.consider(label, self._pass(**settings))

    def best_greedy(self) -> Candidate | None:
        """The best kept candidate a greedy run made (None if none fits)."""
        return next((c for c in self.pool.ranked() if c.label in self.settings), None)
