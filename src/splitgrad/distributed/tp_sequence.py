"""Moving activations in and out of the sequence-parallel region (dim 0 sharded over the TP group).

Three differentiable transitions, named by what the consumer of the result does:

* :func:`split_sequence` — a replicated tensor ``(s, ...)`` enters the region: each rank keeps its dim-0 block;
  the gradients of the blocks are all-gathered (every rank's replicated producer needs the whole gradient).
* :func:`gather_sequence` with ``partial_grad=False`` — the region's output feeds a **replicated** consumer
  (GPT's head): all-gather; every rank's gradient of the full tensor is the same, so backward keeps its block.
* :func:`gather_sequence` with ``partial_grad=True`` — the gathered tensor feeds a **tensor-parallel** consumer
  (TE's ``return_layernorm_output_gathered``): each rank's gradient is partial, so backward reduce-scatters.

These are Megatron's ``scatter_to_sequence_parallel_region`` / ``gather_from_sequence_parallel_region``
(with ``tensor_parallel_output_grad``); on a one-rank or non-sequence-parallel config each is the identity.
"""

from __future__ import annotations

import torch

from .tp_comm import all_gather_dim0, check_dim0_divisible, reduce_scatter_dim0
from .tp_config import TensorParallelConfig

__all__ = ["gather_sequence", "sequence_block", "split_sequence"]


def sequence_block(x: torch.Tensor, cfg: TensorParallelConfig) -> torch.Tensor:
    """This rank's dim-0 block of ``x: (s, ...)`` -> ``(s / size, ...)`` (a view).

    Raises:
        ValueError: ``s`` is not divisible by the group size.
    """
    check_dim0_divisible(x, cfg, "sequence parallelism needs dim 0 (the sequence)")
    n = x.shape[0] // cfg.size
    return x[cfg.rank * n : (cfg.rank + 1) * n]


class _SplitSequenceFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cfg: TensorParallelConfig):  # type: ignore[override]
        ctx.cfg = cfg
        return sequence_block(x, cfg).clone()  # a view would tie the shard's storage to the whole input

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        return all_gather_dim0(dy, ctx.cfg).wait(), None


class _GatherSequenceFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cfg: TensorParallelConfig, partial_grad: bool):  # type: ignore[override]
        ctx.cfg, ctx.partial_grad = cfg, partial_grad
        return all_gather_dim0(x, cfg).wait()

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        if ctx.partial_grad:
            return reduce_scatter_dim0(dy, ctx.cfg).wait(), None, None
        return sequence_block(dy, ctx.cfg).contiguous(), None, None


def split_sequence(x: torch.Tensor, cfg: TensorParallelConfig) -> torch.Tensor:
    """``x: (s, ...)`` replicated on the TP ranks -> this rank's ``(s / tp, ...)``; backward all-gathers."""
    if not cfg.sequence_parallel:
        return x
    return _SplitSequenceFunction.apply(x, cfg)


def gather_sequence(x: torch.Tensor, cfg: TensorParallelConfig, *, partial_grad: bool) -> torch.Tensor:
    """``x: (s / tp, ...)`` -> ``(s, ...)`` in rank order (see the module docstring for ``partial_grad``)."""
    if not cfg.sequence_parallel:
        return x
    return _GatherSequenceFunction.apply(x, cfg, partial_grad)
