"""The norm half of the one-Function ``LayerNormLinear`` / ``LayerNormMLP`` paths (no tensor parallelism).

Both Functions normalise the flattened input before their first GEMM and turn the gradient of the norm's
output back into ``(dx, dgamma, dbeta)``; one implementation keeps their numerics identical.
"""

from __future__ import annotations

from typing import Any

import torch

from ..functional.norm import effective_gamma, norm_backward, norm_forward

__all__ = ["fused_norm_backward", "fused_norm_forward"]


def fused_norm_forward(
    ctx: Any, owner: Any, x: torch.Tensor, ln_weight: torch.Tensor, ln_bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]:
    """Normalise ``x: (..., hidden)`` with ``owner``'s settings; records on ``ctx`` what the backward needs.

    Args:
        ctx: the Function's context (gets ``normalization`` and ``x_shape``).
        owner: the module (``normalization``, ``eps``, ``zero_centered_gamma``).
        x: the input; ln_weight, ln_bias: ``(hidden,)`` (``ln_bias`` None for RMSNorm).

    Returns:
        ``(x2, gamma, ln_out, stats)``: ``x2: (tokens, hidden)`` the flattened input, ``gamma: (hidden,)`` the
        scale applied, ``ln_out: (tokens, hidden)`` and the statistics ``norm_backward`` takes.
    """
    ctx.normalization = owner.normalization
    ctx.x_shape = x.shape
    x2 = x.reshape(-1, x.shape[-1])
    gamma = effective_gamma(ln_weight, owner.zero_centered_gamma)
    ln_out, stats = norm_forward(x2, gamma, ln_bias, normalization=owner.normalization, eps=owner.eps)
    return x2, gamma, ln_out, stats


def fused_norm_backward(
    ctx: Any,
    dln: torch.Tensor,
    x2: torch.Tensor,
    stats: list[torch.Tensor],
    gamma: torch.Tensor,
    ln_bias: torch.Tensor | None,
    output_mask: tuple[bool, bool, bool],
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """``(dx, dgamma, dbeta)`` from ``dln: (tokens, hidden)``, the gradient of :func:`fused_norm_forward`'s output.

    ``dx`` comes back in the input's shape; an entry of ``output_mask`` that is False gives None.
    """
    dx, dg, dbeta = norm_backward(
        dln, x2, tuple(stats), gamma, ln_bias, normalization=ctx.normalization, output_mask=output_mask
    )
    if dx is not None:
        dx = dx.view(ctx.x_shape)
    return dx, dg, dbeta
