"""Backward fusion ``Bias + activation``: the activation's backward and the bias-gradient reduction together.

Unfused, the activation op returns ``dz`` and the bias op then reduces it; fused, one step does both, reading
``dz`` while it is hot. In plain PyTorch this saves only dispatch overhead (there is no single dact+dbias
kernel to call); the fusion is the place a custom kernel would go, and keeps the arithmetic identical
(bitwise equal to the unfused ops).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..basic.activation import Activation
from ..basic.bias import Bias
from ..op import FusedOperation, OperationContext, ParamGrads

__all__ = ["BackwardActivationBias", "fuse_backward_activation_bias"]


class BackwardActivationBias(FusedOperation):
    """Backward of ``act(x + b)``: ``dz = act'(dy)``, ``db = sum(dz)``, ``dx = dz``.

    Args:
        bias: the :class:`Bias`.
        activation: the :class:`~splitgrad.ops.basic.activation.Activation` that follows it.
    """

    def __init__(self, bias: Bias, activation: Activation) -> None:
        super().__init__([bias, activation])
        self.bias, self.activation = bias, activation

    def fuser_backward(
        self, ctxs: Sequence[OperationContext], dy: torch.Tensor
    ) -> tuple[torch.Tensor | None, list[ParamGrads]]:
        bias_ctx, act_ctx = ctxs
        if not act_ctx.input_requires_grad:  # nothing before the activation needs a gradient
            return None, [[None], []]
        (saved,) = act_ctx.saved_tensors
        dz = self.activation.activate_backward(dy, saved)
        db = dz.reshape(-1, self.bias.size).sum(0) if bias_ctx.weight_requires_grad else None
        return (dz if bias_ctx.input_requires_grad else None), [[db], []]


def fuse_backward_activation_bias(ops: list) -> list:
    """Replace each ``Bias, Activation`` window by a :class:`BackwardActivationBias`."""
    out, i = [], 0
    while i < len(ops):
        if i + 1 < len(ops) and isinstance(ops[i], Bias) and isinstance(ops[i + 1], Activation):
            out.append(BackwardActivationBias(ops[i], ops[i + 1]))
            i += 2
        else:
            out.append(ops[i])
            i += 1
    return out
