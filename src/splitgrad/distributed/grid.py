"""Process groups of a 2-D rank grid: contiguous "inner" blocks and the strided "outer" groups across them.

Tensor parallelism (TP inner, data/pipeline outer) and pipeline parallelism (pipeline inner, data-parallel
replicas outer) lay ranks out the same way; one function creates both kinds of groups so that every caller
issues the ``new_group`` collectives in the same order.
"""

from __future__ import annotations

from typing import NamedTuple

import torch.distributed as dist

__all__ = ["GridGroups", "grid_groups"]


class GridGroups(NamedTuple):
    """This rank's place in the grid and its two groups."""

    inner_rank: int
    """This rank's index in its inner group (``rank % inner_size``)."""
    inner_group: dist.ProcessGroup
    """The ``inner_size`` adjacent ranks ``[k * inner_size, (k + 1) * inner_size)`` holding this rank."""
    outer_rank: int
    """Which inner block this rank is in (``rank // inner_size``)."""
    outer_group: dist.ProcessGroup | None
    """The ranks with the same ``inner_rank``; None when there is a single inner block."""


def grid_groups(inner_size: int, *, backend: str | None = None) -> GridGroups:
    """Create every inner group, then every outer group (a collective: all ranks call it, in the same order).

    Args:
        inner_size: ranks per inner group; the caller has checked that it divides the world size.
        backend: backend of the new groups (default: the default group's).

    Returns:
        This rank's ranks and groups in the grid.
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    n_outer = world // inner_size
    inner_groups = [
        dist.new_group(list(range(k * inner_size, (k + 1) * inner_size)), backend=backend)
        for k in range(n_outer)
    ]
    outer_groups = [
        dist.new_group(list(range(t, world, inner_size)), backend=backend) for t in range(inner_size)
    ]
    outer_rank, inner_rank = divmod(rank, inner_size)
    return GridGroups(
        inner_rank=inner_rank,
        inner_group=inner_groups[outer_rank],
        outer_rank=outer_rank,
        outer_group=outer_groups[inner_rank] if n_outer > 1 else None,
    )
