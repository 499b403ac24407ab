"""PyTorch's schedule-test grid and schedule classes built without processes (shared by the oracle tests).

``GRID`` is ``TestSchedulePlan.setUp``'s ``(num_local_stages, num_microbatches, group_size)`` list in PyTorch's
``test/distributed/pipelining/test_schedule.py`` (the version matching torch 2.13), duplicates included, as
there. :func:`torch_schedule` builds a PyTorch schedule class over stand-in stages, as that test's
``MockPipelineStage`` does: a schedule's constructor only reads the stages' counts.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import torch

GRID = (
    (2, 2, 2),
    (2, 4, 4),
    (2, 8, 2),
    (2, 8, 4),
    (2, 8, 8),
    (4, 4, 4),
    (4, 8, 4),
    (4, 8, 8),
    (4, 16, 4),
    (4, 32, 4),
    (4, 64, 4),
    (4, 16, 16),
    (4, 32, 32),
    (4, 128, 64),
    (3, 2, 2),
    (3, 8, 2),
    (3, 12, 4),
    (4, 6, 3),
    (4, 10, 5),
    (2, 3, 4),
    (2, 4, 4),
    (2, 10, 4),
    (2, 15, 4),
)


def torch_schedule(cls: type, n_local: int, n_microbatches: int, group_size: int, rank: int = 0):
    """``cls(stages, n_microbatches)`` over ``n_local`` stand-in stages of a ``group_size``-rank pipeline."""
    stages = [
        SimpleNamespace(
            num_stages=n_local * group_size,
            group_size=group_size,
            group_rank=rank,
            submod=torch.nn.Identity(),
        )
        for _ in range(n_local)
    ]
    # The constructors log a warning per schedule when microbatches < stages; the grid has many such cases.
    logger = logging.getLogger("torch.distributed.pipelining.schedules")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        return cls(stages, n_microbatches)
    finally:
        logger.setLevel(level)
