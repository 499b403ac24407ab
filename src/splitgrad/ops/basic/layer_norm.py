"""``ops.LayerNorm``: ``nn.LayerNorm`` as a basic op (same parameters, kernels and state_dict)."""

from __future__ import annotations

import torch

from ..op import OperationContext, ParamGrads
from ._norm_common import NormOperation, check_normalized_input, normalized_shape_tuple

# normalized_shape_tuple: re-exported from where it used to live.
__all__ = ["LayerNorm", "normalized_shape_tuple"]


class LayerNorm(NormOperation):
    """``(x - mean) * rstd * weight + bias`` over the trailing ``normalized_shape`` dimensions.

    The forward and backward call ATen's ``native_layer_norm`` / ``native_layer_norm_backward`` (what
    ``F.layer_norm`` and its autograd use), so results match ``nn.LayerNorm`` bitwise. Its gradients are never
    deferred.

    Args:
        normalized_shape: trailing dimensions to normalise.
        eps: added to the variance.
        dtype: parameter dtype (default: torch's default dtype).
        device: parameter device.

    Shapes: ``x: (..., *normalized_shape)`` -> same.
    """

    _label = "ops.LayerNorm"
    _has_bias = True

    def op_forward(self, ctx: OperationContext, x: torch.Tensor) -> torch.Tensor:
        check_normalized_input(self, x, self.normalized_shape)
        y, mean, rstd = torch.ops.aten.native_layer_norm(
            x, self.normalized_shape, self.weight, self.bias, self.eps
        )
        if ctx.requires_grad:
            ctx.save_for_backward(x, mean, rstd, self.weight, self.bias)
        return y

    def op_backward(self, ctx: OperationContext, dy: torch.Tensor) -> tuple[torch.Tensor | None, ParamGrads]:
        x, mean, rstd, weight, bias = ctx.saved_tensors
        mask = [ctx.input_requires_grad, ctx.weight_requires_grad, ctx.weight_requires_grad]
        dx, dw, db = torch.ops.aten.native_layer_norm_backward(
            dy, x, self.normalized_shape, mean, rstd, weight, bias, mask
        )
        return (dx if mask[0] else None), [dw if mask[1] else None, db if mask[2] else None]
