"""``ops.Bias``: ``y = x + bias`` over the last dimension."""

from __future__ import annotations

import torch
from torch import nn

from ..op import BasicOperation, OperationContext, ParamGrads

__all__ = ["Bias"]


class Bias(BasicOperation):
    """Add a learned ``bias: (size,)`` to the last dimension.

    The bias gradient is always returned to autograd in the main backward (it is a cheap reduction with no
    GEMM to move off the critical path), so ``bias`` is not among the deferred parameters of a
    :class:`~splitgrad.ops.Sequential` or :class:`~splitgrad.ops.Linear`.

    Args:
        size: number of features.
        dtype: parameter dtype (default: torch's default dtype).
        device: parameter device.

    Shapes: ``x: (..., size)`` -> ``(..., size)``.
    """

    def __init__(
        self, size: int, *, dtype: torch.dtype | None = None, device: torch.device | str | None = None
    ) -> None:
        super().__init__()
        if size <= 0:
            raise ValueError(f"ops.Bias needs a positive size, got {size=}")
        self.size = size
        self.bias = nn.Parameter(torch.zeros(size, dtype=dtype, device=device))

    def check_input(self, x: torch.Tensor) -> None:
        if x.dim() == 0 or x.shape[-1] != self.size:
            raise ValueError(
                f"{self._describe()}: input's last dimension must be size={self.size}, got input shape {tuple(x.shape)}"
            )

    def op_forward(self, ctx: OperationContext, x: torch.Tensor) -> torch.Tensor:
        self.check_input(x)
        return x + self.bias

    def op_backward(self, ctx: OperationContext, dy: torch.Tensor) -> tuple[torch.Tensor | None, ParamGrads]:
        db = dy.reshape(-1, self.size).sum(0) if ctx.weight_requires_grad else None
        return (dy if ctx.input_requires_grad else None), [db]

    def extra_repr(self) -> str:
        return f"size={self.size}"
