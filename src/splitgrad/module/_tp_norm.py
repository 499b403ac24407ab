"""The norm of the tensor-parallel ``LayerNormLinear`` / ``LayerNormMLP`` paths, through plain autograd.

Under tensor parallelism the norm runs on what this rank holds (the full activation, or its sequence shard
under sequence parallelism) before the linear's communication, so it cannot live inside the linear's autograd
Function; torch's own ops give its gradients (``layer_norm_weight``/``layer_norm_bias`` always flow through
autograd, in every mode).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["module_norm_autograd", "norm_autograd"]


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


def module_norm_autograd(owner: Any, x: torch.Tensor) -> torch.Tensor:
    """:func:`norm_autograd` with ``owner``'s norm parameters and settings (``LayerNormLinear``/``LayerNormMLP``)."""
    return norm_autograd(
        x, owner.layer_norm_weight, owner.layer_norm_bias, normalization=owner.normalization,
        eps=owner.eps, zero_centered_gamma=owner.zero_centered_gamma,
    )  # fmt: skip
