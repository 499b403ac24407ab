"""Tensor parallelism: the config and collectives the TP layers use, and the process-group helper.

The layers themselves are ``splitgrad.Linear`` / ``LayerNormLinear`` / ``LayerNormMLP`` with TE's keywords
(``tp_group``, ``parallel_mode``, ``sequence_parallel``, ...); see ``docs/tensor_parallel.md``. The config and
collectives live in ``splitgrad.functional`` (the modules need them and sit below ``parallel``) and are
re-exported here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from ..functional.tp_comm import PendingCollective, all_gather_dim0, all_reduce, reduce_scatter_dim0
from ..functional.tp_config import TensorParallelConfig, tensor_parallel_config

__all__ = [
    "PendingCollective",
    "TensorParallelConfig",
    "TensorParallelGroups",
    "all_gather_dim0",
    "all_reduce",
    "reduce_scatter_dim0",
    "tensor_parallel_config",
    "tensor_parallel_groups",
]


@dataclass(frozen=True, kw_only=True, slots=True)
class TensorParallelGroups:
    """This rank's place in a ``tp_size``-wide tensor-parallel layout (Megatron's: TP ranks are adjacent)."""

    tp_rank: int
    """Rank inside the tensor-parallel group."""
    tp_group: dist.ProcessGroup
    """The ``tp_size`` adjacent ranks ``[k * tp_size, (k + 1) * tp_size)`` this rank belongs to."""
    outer_rank: int
    """Index ``k`` of this rank's TP group: its rank in ``outer_group``."""
    outer_group: dist.ProcessGroup | None
    """The ranks with the same ``tp_rank`` (``tp_rank, tp_rank + tp_size, ...``): the group a pipeline or a
    data-parallel wrapper of this TP shard runs over; None when there is a single TP group."""


def tensor_parallel_groups(tp_size: int, *, backend: str | None = None) -> TensorParallelGroups:
    """Create every TP group and every "outer" group (a collective: all ranks call it, in the same order).

    Args:
        tp_size: ranks per tensor-parallel group; must divide the world size.
        backend: backend of the new groups (default: the default group's).

    Raises:
        ValueError: ``tp_size`` does not divide the world size.
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    if tp_size < 1 or world % tp_size:
        raise ValueError(
            f"tensor_parallel_groups: tp_size must divide the world size, got {tp_size=} {world=}"
        )
    n_outer = world // tp_size
    tp_groups = [
        dist.new_group(list(range(k * tp_size, (k + 1) * tp_size)), backend=backend) for k in range(n_outer)
    ]
    outer_groups = [dist.new_group(list(range(t, world, tp_size)), backend=backend) for t in range(tp_size)]
    outer_rank, tp_rank = divmod(rank, tp_size)
    return TensorParallelGroups(
        tp_rank=tp_rank,
        tp_group=tp_groups[outer_rank],
        outer_rank=outer_rank,
        outer_group=outer_groups[tp_rank] if n_outer > 1 else None,
    )
