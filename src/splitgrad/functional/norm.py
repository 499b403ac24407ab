"""LayerNorm / RMSNorm forward and explicit backward shared by the ``LayerNorm*`` modules.

The modules fuse the norm into their own autograd Function (so its input gradient and the linear's dgrad come
out of one backward), hence they need the norm's backward as plain functions. The forward calls the same ATen
kernels as ``F.layer_norm`` / ``F.rms_norm``, so outputs match plain PyTorch bitwise; the statistics they
return (mean, rstd) are kept for the backward instead of being recomputed.

The norm's own gradients (gamma, beta) are never deferred: they are returned to autograd in the main backward.
"""

from __future__ import annotations

import torch

__all__ = [
    "NORMALIZATIONS",
    "NormStats",
    "check_normalization",
    "effective_gamma",
    "init_norm_",
    "norm_backward",
    "norm_forward",
]

NORMALIZATIONS = ("LayerNorm", "RMSNorm")

#: ``(mean, rstd)`` for LayerNorm, ``(rstd,)`` for RMSNorm; each ``(tokens, 1)``.
NormStats = tuple[torch.Tensor, ...]


def check_normalization(owner: str, normalization: str) -> None:
    """Raise ``ValueError`` unless ``normalization`` is one of :data:`NORMALIZATIONS`."""
    if normalization not in NORMALIZATIONS:
        raise ValueError(f"{owner}: normalization must be one of {NORMALIZATIONS}, got {normalization=}")


def init_norm_(weight: torch.Tensor, bias: torch.Tensor | None, zero_centered_gamma: bool) -> None:
    """Identity norm: gamma ones (zeros when zero-centered, since the scale is ``1 + weight``), beta zeros."""
    with torch.no_grad():
        weight.fill_(0.0 if zero_centered_gamma else 1.0)
        if bias is not None:
            bias.zero_()


def effective_gamma(weight: torch.Tensor, zero_centered_gamma: bool) -> torch.Tensor:
    """The scale actually applied: ``1 + weight`` with zero-centered gamma (TE's convention), else ``weight``."""
    return weight + 1 if zero_centered_gamma else weight


def norm_forward(
    x: torch.Tensor,
    gamma: torch.Tensor,
    beta: torch.Tensor | None,
    *,
    normalization: str,
    eps: float,
) -> tuple[torch.Tensor, NormStats]:
    """Normalise the rows of ``x``.

    Args:
        x: ``(tokens, features)``.
        gamma: ``(features,)`` effective scale (see :func:`effective_gamma`).
        beta: ``(features,)`` shift (LayerNorm only) or None.
        normalization: ``"LayerNorm"`` or ``"RMSNorm"`` (``x * rsqrt(mean(x^2) + eps) * gamma``).
        eps: added to the variance / mean square.

    Returns:
        ``(y, stats)`` with ``y: (tokens, features)`` and the statistics :func:`norm_backward` needs.
    """
    shape = [x.shape[-1]]
    if normalization == "LayerNorm":
        y, mean, rstd = torch.ops.aten.native_layer_norm(x, shape, gamma, beta, eps)
        return y, (mean, rstd)
    fused = getattr(torch.ops.aten, "_fused_rms_norm", None)
    if fused is not None:
        y, rstd = fused(x, shape, gamma, eps)
        return y, (rstd,)
    # torch < 2.8: the same composite arithmetic F.rms_norm uses there.
    xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True).add_(eps))
    return (xf * rstd).type_as(x) * gamma, (rstd,)


def norm_backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    stats: NormStats,
    gamma: torch.Tensor,
    beta: torch.Tensor | None,
    *,
    normalization: str,
    output_mask: tuple[bool, bool, bool],
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Gradients of :func:`norm_forward` for the output gradient ``dy``.

    Args:
        dy: ``(tokens, features)`` gradient of the normalised output.
        x: ``(tokens, features)`` the forward's input.
        stats: what :func:`norm_forward` returned.
        gamma: ``(features,)`` effective scale used in the forward.
        beta: ``(features,)`` shift or None.
        normalization: as in the forward.
        output_mask: which of ``(dx, dgamma, dbeta)`` to compute.

    Returns:
        ``(dx, dgamma, dbeta)``; entries not asked for (or without a parameter) are None. ``dgamma`` is also
        the gradient of the raw zero-centered weight, since ``d(1 + w) / dw = 1``.
    """
    want_x, want_g, want_b = output_mask
    if normalization == "LayerNorm":
        mask = [want_x, want_g, want_b and beta is not None]
        dx, dg, db = torch.ops.aten.native_layer_norm_backward(
            dy, x, [x.shape[-1]], stats[0], stats[1], gamma, beta, mask
        )
        return (dx if want_x else None), (dg if want_g else None), (db if mask[2] else None)
    return (*_rms_norm_backward(dy, x, stats[0], gamma, want_x, want_g), None)


def _rms_norm_backward(
    dy: torch.Tensor, x: torch.Tensor, rstd: torch.Tensor, gamma: torch.Tensor, want_x: bool, want_g: bool
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    # y = xhat * gamma, xhat = x * rstd  =>  dx = rstd * (g - xhat * mean(g * xhat)), g = dy * gamma.
    # Reduced-precision inputs are computed in fp32 (rstd's dtype), as torch's own kernels do.
    compute = rstd.dtype
    xhat = x.to(compute) * rstd
    dyc = dy.to(compute)
    dg = (dyc * xhat).sum(0).to(gamma.dtype) if want_g else None
    dx = None
    if want_x:
        g = dyc * gamma.to(compute)
        dx = (rstd * (g - xhat * (g * xhat).mean(-1, keepdim=True))).to(x.dtype)
    return dx, dg
