"""The norm of the tensor-parallel ``LayerNormLinear`` / ``LayerNormMLP`` paths, through plain autograd.

Under tensor parallelism the norm runs on what this rank holds (the full activation, or its sequence shard
under sequence parallelism) before the linear's communication, so it cannot live inside the linear's autograd
Function; torch's own ops give its gradients (``layer_norm_weight``/``layer_norm_bias`` always flow through
autograd, in every mode).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..functional.tp_comm import all_gather_dim0, reduce_scatter_dim0
from ..functional.tp_config import TensorParallelConfig

__all__ = ["gather_sequence", "norm_autograd"]


def norm_autograd(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    normalization: str,
    eps: float,
    zero_centered_gamma: bool,
) -> torch.Tensor:
    """LayerNorm or RMSNorm over the last dim of ``x: (..., hidden)`` with ``weight/bias: (hidden,)``."""
    gamma = 1 + weight if zero_centered_gamma else weight
    if normalization == "LayerNorm":
        return F.layer_norm(x, (x.shape[-1],), gamma, bias, eps)
    return F.rms_norm(x, (x.shape[-1],), gamma, eps)


class _GatherSequenceFunction(torch.autograd.Function):
    """All-gather on dim 0 in forward; reduce-scatter of the gradient in backward (every rank's copy is used)."""

    @staticmethod
    def forward(ctx, x, cfg: TensorParallelConfig):  # type: ignore[override]
        ctx.cfg = cfg
        return all_gather_dim0(x, cfg).wait()

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        return reduce_scatter_dim0(dy, ctx.cfg).wait(), None


def gather_sequence(x: torch.Tensor, cfg: TensorParallelConfig) -> torch.Tensor:
    """``x: (s/tp, ...)`` -> ``(s, ...)`` under sequence parallelism (differentiable); else ``x`` itself.

    Used for TE's ``return_layernorm_output_gathered``: the gathered norm output may feed a replicated
    computation on every TP rank, so its gradient is the sum over ranks, reduce-scattered to the shard.
    """
    if not cfg.sequence_parallel:
        return x
    return _GatherSequenceFunction.apply(x, cfg)
