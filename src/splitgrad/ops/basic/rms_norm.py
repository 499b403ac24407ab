"""``ops.RMSNorm``: ``x * rsqrt(mean(x^2) + eps) * weight`` as a basic op (``nn.RMSNorm``'s parameters)."""

from __future__ import annotations

import torch
from torch import nn

from ..op import BasicOperation, OperationContext, ParamGrads
from .layer_norm import check_normalized_input, normalized_shape_tuple

__all__ = ["RMSNorm"]


class RMSNorm(BasicOperation):
    """Root-mean-square normalisation over the trailing ``normalized_shape`` dimensions, scaled by ``weight``.

    The forward uses ATen's ``_fused_rms_norm`` (what ``F.rms_norm`` runs) where torch has it, else the same
    arithmetic written out; the backward is written out (ATen's ``_fused_rms_norm_backward`` has no CPU
    kernel), computing in the statistics' dtype (fp32 for half inputs). Its gradient is never deferred.

    Args:
        normalized_shape: trailing dimensions to normalise.
        eps: added to the mean square (TE's default 1e-5; ``nn.RMSNorm`` defaults to the dtype's epsilon).
        dtype: parameter dtype (default: torch's default dtype).
        device: parameter device.

    Shapes: ``x: (..., *normalized_shape)`` -> same.
    """

    def __init__(
        self,
        normalized_shape: int | tuple[int, ...] | list[int],
        eps: float = 1e-5,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.normalized_shape = normalized_shape_tuple("ops.RMSNorm", normalized_shape)
        if eps < 0:
            raise ValueError(f"ops.RMSNorm needs eps >= 0, got {eps=}")
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(self.normalized_shape, dtype=dtype, device=device))

    def _dims(self) -> list[int]:
        return list(range(-len(self.normalized_shape), 0))

    def op_forward(self, ctx: OperationContext, x: torch.Tensor) -> torch.Tensor:
        check_normalized_input(self, x, self.normalized_shape)
        fused = getattr(torch.ops.aten, "_fused_rms_norm", None)
        if fused is not None:
            y, rstd = fused(x, list(self.normalized_shape), self.weight, self.eps)
        else:  # torch < 2.8
            xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
            rstd = torch.rsqrt(xf.pow(2).mean(self._dims(), keepdim=True).add_(self.eps))
            y = (xf * rstd).type_as(x) * self.weight
        if ctx.requires_grad:
            ctx.save_for_backward(x, rstd, self.weight)
        return y

    def op_backward(self, ctx: OperationContext, dy: torch.Tensor) -> tuple[torch.Tensor | None, ParamGrads]:
        x, rstd, weight = ctx.saved_tensors
        want_x, want_w = ctx.input_requires_grad, ctx.weight_requires_grad
        # y = xhat * w, xhat = x * rstd  =>  dx = rstd * (g - xhat * mean(g * xhat)), g = dy * w.
        dims = self._dims()
        xhat = x.to(rstd.dtype) * rstd
        dyc = dy.to(rstd.dtype)
        lead = list(range(x.dim() - len(dims)))
        dw = None
        if want_w:
            # sum over no dimension would reduce everything; an unbatched input keeps the product as is.
            dw = ((dyc * xhat).sum(lead) if lead else dyc * xhat).to(weight.dtype)
        dx = None
        if want_x:
            g = dyc * weight.to(rstd.dtype)
            dx = (rstd * (g - xhat * (g * xhat).mean(dims, keepdim=True))).to(x.dtype)
        return dx, [dw]

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}"
