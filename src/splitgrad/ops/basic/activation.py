"""Activation ops: ``GELU`` (tanh approximation), ``ReLU``, ``SiLU`` and the gated ``SwiGLU``, ``GEGLU``.

One file for the family (as TE does): each op is a forward and a backward of a few lines over the same
base. Every backward calls the ATen backward kernel plain autograd would (``gelu_backward``,
``threshold_backward``, ``silu_backward``), so results match ``torch.nn.functional`` bitwise.

Gated ops read ``x = [a, b]`` (halves of the last dimension) and return ``act(a) * b`` with half the
features, the convention of TE and of :class:`splitgrad.LayerNormMLP`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..op import BasicOperation, OperationContext, ParamGrads

__all__ = ["GEGLU", "GELU", "Activation", "ReLU", "SiLU", "SwiGLU"]


class Activation(BasicOperation):
    """Base of parameter-free element-wise activations.

    Subclasses implement :meth:`activate` (forward) and :meth:`activate_backward`; by default the input is
    saved for backward (:attr:`saves_output` switches to the output, as ReLU's autograd does).

    Shapes: ``x: (..., features)`` -> ``(..., features)`` (gated: ``(..., 2 * n)`` -> ``(..., n)``).
    """

    saves_output = False

    def activate(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def activate_backward(self, dy: torch.Tensor, saved: torch.Tensor) -> torch.Tensor:
        """Gradient w.r.t. the input for output gradient ``dy``; ``saved`` is the input (or output)."""
        raise NotImplementedError

    def op_forward(self, ctx: OperationContext, x: torch.Tensor) -> torch.Tensor:
        y = self.activate(x)
        if ctx.input_requires_grad:
            ctx.save_for_backward(y if self.saves_output else x)
        return y

    def op_backward(self, ctx: OperationContext, dy: torch.Tensor) -> tuple[torch.Tensor | None, ParamGrads]:
        if not ctx.input_requires_grad:
            return None, []
        (saved,) = ctx.saved_tensors
        return self.activate_backward(dy, saved), []


class GELU(Activation):
    """``gelu(x)`` with the tanh approximation (TE's GELU; ``nn.GELU(approximate="tanh")``)."""

    def activate(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(x, approximate="tanh")

    def activate_backward(self, dy: torch.Tensor, saved: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten.gelu_backward(dy, saved, approximate="tanh")


class ReLU(Activation):
    """``max(x, 0)``."""

    saves_output = True

    def activate(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x)

    def activate_backward(self, dy: torch.Tensor, saved: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten.threshold_backward(dy, saved, 0)


class SiLU(Activation):
    """``x * sigmoid(x)``."""

    def activate(self, x: torch.Tensor) -> torch.Tensor:
        return F.silu(x)

    def activate_backward(self, dy: torch.Tensor, saved: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten.silu_backward(dy, saved)


class _Gated(Activation):
    """``act(a) * b`` for ``x = [a, b]``; backward recomputes ``act(a)`` rather than saving it."""

    def _halves(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if x.dim() == 0 or x.shape[-1] % 2:
            raise ValueError(
                f"{self._describe()}: gated activations need an even last dimension, got input shape "
                f"{tuple(x.shape)}"
            )
        a, b = x.chunk(2, dim=-1)
        return a, b

    def gate(self, a: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def gate_backward(self, dy: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def activate(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self._halves(x)
        return self.gate(a) * b

    def activate_backward(self, dy: torch.Tensor, saved: torch.Tensor) -> torch.Tensor:
        a, b = saved.chunk(2, dim=-1)
        return torch.cat([self.gate_backward(dy * b, a), dy * self.gate(a)], dim=-1)


class SwiGLU(_Gated):
    """``silu(a) * b`` for ``x = [a, b]``."""

    def gate(self, a: torch.Tensor) -> torch.Tensor:
        return F.silu(a)

    def gate_backward(self, dy: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten.silu_backward(dy, a)


class GEGLU(_Gated):
    """``gelu_tanh(a) * b`` for ``x = [a, b]`` (tanh approximation, as TE)."""

    def gate(self, a: torch.Tensor) -> torch.Tensor:
        return F.gelu(a, approximate="tanh")

    def gate_backward(self, dy: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten.gelu_backward(dy, a, approximate="tanh")
