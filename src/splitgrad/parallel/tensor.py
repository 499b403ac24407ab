"""Tensor parallelism: the config and collectives the TP layers use, and the process-group helper.

The layers themselves are ``splitgrad.Linear`` / ``LayerNormLinear`` / ``LayerNormMLP`` with TE's keywords
(``tp_group``, ``parallel_mode``, ``sequence_parallel``, ...); see ``docs/tensor_parallel.md``. The config and
collectives live in ``splitgrad.distributed`` (the modules need them and sit below ``parallel``) and are
re-exported here: this module is their public home.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..distributed.grid import grid_groups
from ..distributed.group_ref import GroupRef
from ..distributed.tp_comm import PendingCollective, all_gather_dim0, all_reduce, reduce_scatter_dim0
from ..distributed.tp_config import DEFAULT_TP_TIMEOUT_S, TensorParallelConfig, tensor_parallel_config
from ..distributed.tp_sequence import gather_sequence, split_sequence
from ..distributed.wait import bounded_wait

__all__ = [
    "PendingCollective",
    "TensorParallelConfig",
    "TensorParallelGroups",
    "all_gather_dim0",
    "all_reduce",
    "allreduce_sequence_parallel_grads",
    "gather_sequence",
    "reduce_scatter_dim0",
    "split_sequence",
    "tensor_parallel_config",
    "tensor_parallel_groups",
]


class TensorParallelGroups:
    """This rank's place in a ``tp_size``-wide tensor-parallel layout (Megatron's: TP ranks are adjacent).

    The groups are held weakly (torch's registry holds them until ``dist.destroy_process_group()``): this
    object, kept in a script's globals, must not keep their gloo workers alive to interpreter exit
    (docs/parallel.md, "A crash at exit"); reading a group after its destruction raises ``RuntimeError``.
    """

    __slots__ = ("_outer", "_tp", "outer_rank", "tp_rank")

    def __init__(
        self,
        *,
        tp_rank: int,
        tp_group: dist.ProcessGroup,
        outer_rank: int,
        outer_group: dist.ProcessGroup | None,
    ) -> None:
        self.tp_rank = tp_rank
        """Rank inside the tensor-parallel group."""
        self.outer_rank = outer_rank
        """Index ``k`` of this rank's TP group: its rank in ``outer_group``."""
        self._tp = GroupRef(tp_group, owner="TensorParallelGroups.tp_group")
        self._outer = (
            None if outer_group is None else GroupRef(outer_group, owner="TensorParallelGroups.outer_group")
        )

    @property
    def tp_group(self) -> dist.ProcessGroup:
        """The ``tp_size`` adjacent ranks ``[k * tp_size, (k + 1) * tp_size)`` this rank belongs to."""
        return self._tp.get()

    @property
    def outer_group(self) -> dist.ProcessGroup | None:
        """The ranks with the same ``tp_rank`` (``tp_rank, tp_rank + tp_size, ...``): the group a pipeline or a
        data-parallel wrapper of this TP shard runs over; None when there is a single TP group."""
        return None if self._outer is None else self._outer.get()

    def __repr__(self) -> str:
        return f"TensorParallelGroups(tp_rank={self.tp_rank}, outer_rank={self.outer_rank})"


def tensor_parallel_groups(tp_size: int, *, backend: str | None = None) -> TensorParallelGroups:
    """Create every TP group and every "outer" group (a collective: all ranks call it, in the same order).

    Args:
        tp_size: ranks per tensor-parallel group; must divide the world size.
        backend: backend of the new groups (default: the default group's).

    Raises:
        ValueError: ``tp_size`` does not divide the world size.
    """
    world = dist.get_world_size()
    if tp_size < 1 or world % tp_size:
        raise ValueError(
            f"tensor_parallel_groups: tp_size must divide the world size, got {tp_size=} {world=}"
        )
    grid = grid_groups(tp_size, backend=backend)
    return TensorParallelGroups(
        tp_rank=grid.inner_rank,
        tp_group=grid.inner_group,
        outer_rank=grid.outer_rank,
        outer_group=grid.outer_group,
    )


@torch.no_grad()
def allreduce_sequence_parallel_grads(
    module: nn.Module, tp_group: dist.ProcessGroup | None, *, timeout_s: float = DEFAULT_TP_TIMEOUT_S
) -> int:
    """Sum the gradients of ``module``'s ``param.sequence_parallel`` parameters over the TP group.

    Under sequence parallelism a replicated parameter applied to this rank's sequence shard (the norms of
    ``LayerNormLinear``/``LayerNormMLP``, a row-parallel bias) gets a partial gradient; Megatron all-reduces
    them over the tensor-parallel group once per step (``_allreduce_layernorm_grads``). Call it once per
    optimizer step, after the last ``backward_dw`` (a deferred row bias is written there) and, under a
    data-parallel wrapper, after its gradient sync (``finish_grad_sync``: the gradients are then all in
    ``main_grad``; both reductions are sums, so the order does not change the result). It reduces
    ``param.main_grad`` where a parameter has one (as Megatron), else ``param.grad``; one flattened
    all-reduce per dtype and device. A collective: every TP rank calls it with the same module structure.

    Args:
        module: the model (or a pipeline stage) whose parameters to reduce.
        tp_group: the tensor-parallel group; None or one rank: nothing to do.
        timeout_s: limit for the all-reduce's wait.

    Returns:
        How many gradients were reduced.

    Raises:
        RuntimeError: a flagged parameter has no gradient (it would leave the ranks out of step), or the
            all-reduce failed or timed out.
    """
    if tp_group is None or dist.get_world_size(tp_group) == 1:
        return 0
    grads: list[torch.Tensor] = []
    for name, param in module.named_parameters():
        if not getattr(param, "sequence_parallel", False) or not param.requires_grad:
            continue
        grad = getattr(param, "main_grad", None)
        grad = param.grad if grad is None else grad
        if grad is None:
            raise RuntimeError(
                f"allreduce_sequence_parallel_grads: {name} (sequence_parallel) has no gradient; run backward "
                "and backward_dw first (every TP rank must reduce the same parameters)"
            )
        grads.append(grad)
    by_kind: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for grad in grads:
        by_kind.setdefault((grad.dtype, grad.device), []).append(grad)
    for (dtype, device), group in by_kind.items():
        flat = torch.cat([g.reshape(-1) for g in group])
        work = dist.all_reduce(flat, group=tp_group, async_op=True)
        bounded_wait(
            work,
            f"allreduce_sequence_parallel_grads: all-reduce of {flat.numel()} {dtype} elements on {device}",
            timeout=timeout_s,
            group=tp_group,
        )
        offset = 0
        for grad in group:
            grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
            offset += grad.numel()
    return len(grads)
