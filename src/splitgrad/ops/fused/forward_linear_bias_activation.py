"""Forward fusion ``BasicLinear + Bias [+ activation]``: one addmm (``F.linear`` with bias), then the activation.

Unfused, the bias is a second pass over the output (``mm`` then ``add``); fused it rides in the GEMM's
epilogue (BLAS ``beta * C``), which is also exactly what ``nn.Linear`` computes. The contexts are filled as the
basic ops would fill them, so any backward (fused or not) can follow.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from ..basic.activation import Activation
from ..basic.basic_linear import BasicLinear
from ..basic.bias import Bias
from ..op import BasicOperation, FusedOperation, OperationContext

__all__ = ["ForwardLinearBiasActivation", "fuse_forward_linear_bias_activation"]


class ForwardLinearBiasActivation(FusedOperation):
    """``act(x @ W.T + b)`` (or ``x @ W.T + b`` without an activation) in one GEMM.

    Args:
        linear: the :class:`BasicLinear`.
        bias: the :class:`Bias` that follows it (``size == linear.out_features``).
        activation: the :class:`~splitgrad.ops.basic.activation.Activation` that follows, or None.
    """

    def __init__(self, linear: BasicLinear, bias: Bias, activation: Activation | None = None) -> None:
        super().__init__([linear, bias] if activation is None else [linear, bias, activation])
        self.linear, self.bias, self.activation = linear, bias, activation

    def fuser_forward(
        self, ctxs: Sequence[OperationContext], x: torch.Tensor, extra_inputs: Sequence[tuple[Any, ...]]
    ) -> torch.Tensor:
        self.linear.prepare_forward(ctxs[0], x)
        z = F.linear(x, self.linear.weight, self.bias.bias)
        return z if self.activation is None else self.activation.op_forward(ctxs[2], z)


def _fusible(linear: BasicOperation, bias: BasicOperation) -> bool:
    if not (isinstance(linear, BasicLinear) and isinstance(bias, Bias)):
        return False
    w, b = linear.weight, bias.bias
    # Unfused, x + bias may promote dtypes; F.linear would refuse mixed ones instead, so only fuse equal ones.
    return bias.size == linear.out_features and w.dtype == b.dtype and w.device == b.device


def fuse_forward_linear_bias_activation(ops: list) -> list:
    """Replace each ``BasicLinear, Bias[, Activation]`` window by a :class:`ForwardLinearBiasActivation`."""
    out, i = [], 0
    while i < len(ops):
        if i + 1 < len(ops) and _fusible(ops[i], ops[i + 1]):
            act = ops[i + 2] if i + 2 < len(ops) and isinstance(ops[i + 2], Activation) else None
            out.append(ForwardLinearBiasActivation(ops[i], ops[i + 1], act))
            i += 2 if act is None else 3
        else:
            out.append(ops[i])
            i += 1
    return out
