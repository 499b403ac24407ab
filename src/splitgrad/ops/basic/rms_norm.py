"""``ops.RMSNorm``: ``x * rsqrt(mean(x^2) + eps) * weight`` as a basic op (``nn.RMSNorm``'s parameters)."""

from __future__ import annotations

import torch

from ...functional.norm import norm_backward, norm_forward
from ..op import OperationContext, ParamGrads
from ._norm_common import NormOperation, check_normalized_input

__all__ = ["RMSNorm"]


class RMSNorm(NormOperation):
    """Root-mean-square normalisation over the trailing ``normalized_shape`` dimensions, scaled by ``weight``.

    Runs :mod:`splitgrad.functional.norm`'s RMSNorm (the one ``LayerNormLinear``/``LayerNormMLP`` use) over the
    flattened trailing dimensions: ATen's ``_fused_rms_norm`` forward where torch has it, and a written-out
    backward in the statistics' dtype (fp32 for half inputs). Its gradient is never deferred.

    Args:
        normalized_shape: trailing dimensions to normalise.
        eps: added to the mean square (TE's default 1e-5; ``nn.RMSNorm`` defaults to the dtype's epsilon).
        dtype: parameter dtype (default: torch's default dtype).
        device: parameter device.

    Shapes: ``x: (..., *normalized_shape)`` -> same.
    """

    _label = "ops.RMSNorm"

    def op_forward(self, ctx: OperationContext, x: torch.Tensor) -> torch.Tensor:
        check_normalized_input(self, x, self.normalized_shape)
        # The module's RMSNorm over the flattened trailing dimensions: one implementation for both APIs.
        x2 = x.reshape(-1, self.weight.numel())
        y, (rstd,) = norm_forward(x2, self.weight.reshape(-1), None, normalization="RMSNorm", eps=self.eps)
        if ctx.requires_grad:
            ctx.save_for_backward(x2, rstd, self.weight)
        return y.view(x.shape)

    def op_backward(self, ctx: OperationContext, dy: torch.Tensor) -> tuple[torch.Tensor | None, ParamGrads]:
        x2, rstd, weight = ctx.saved_tensors
        dx, dw, _ = norm_backward(
            dy.reshape(x2.shape), x2, (rstd,), weight.reshape(-1), None,
            normalization="RMSNorm", output_mask=(ctx.input_requires_grad, ctx.weight_requires_grad, False),
        )  # fmt: skip
        return (None if dx is None else dx.view(dy.shape)), [None if dw is None else dw.view(weight.shape)]
