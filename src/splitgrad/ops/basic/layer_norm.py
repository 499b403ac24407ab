"""``ops.LayerNorm``: ``nn.LayerNorm`` as a basic op (same parameters, kernels and state_dict)."""

from __future__ import annotations

import torch
from torch import nn

from ..op import BasicOperation, OperationContext, ParamGrads

__all__ = ["LayerNorm", "normalized_shape_tuple"]


def normalized_shape_tuple(
    owner: str, normalized_shape: int | tuple[int, ...] | list[int]
) -> tuple[int, ...]:
    """``normalized_shape`` as a tuple of positive ints, or ``ValueError`` naming ``owner``."""
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    if not shape or any(not isinstance(n, int) or n <= 0 for n in shape):
        raise ValueError(f"{owner} needs positive normalized_shape, got {normalized_shape=}")
    return shape


def check_normalized_input(op: BasicOperation, x: torch.Tensor, shape: tuple[int, ...]) -> None:
    """Raise ``ValueError`` naming ``op`` unless ``x`` ends with ``shape``."""
    if x.dim() < len(shape) or tuple(x.shape[-len(shape) :]) != shape:
        raise ValueError(
            f"{op._describe()}: input's trailing dimensions must be normalized_shape={shape}, got input shape "
            f"{tuple(x.shape)}"
        )


class LayerNorm(BasicOperation):
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

    def __init__(
        self,
        normalized_shape: int | tuple[int, ...] | list[int],
        eps: float = 1e-5,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.normalized_shape = normalized_shape_tuple("ops.LayerNorm", normalized_shape)
        if eps < 0:
            raise ValueError(f"ops.LayerNorm needs eps >= 0, got {eps=}")
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(self.normalized_shape, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.zeros(self.normalized_shape, dtype=dtype, device=device))

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

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}"
