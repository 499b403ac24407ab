"""The fusible-operation contract: basic ops, fused ops and the per-forward context they share.

A **basic op** is the unit a user composes (``BasicLinear``, ``Bias``, ``GELU`` …). It implements two
methods and never touches autograd itself:

* ``op_forward(ctx, x, *extra_inputs) -> y``
* ``op_backward(ctx, dy) -> (dx, param_grads)`` — ``param_grads`` lines up with :meth:`BasicOperation.op_parameters`;
  the gradients are *returned*, the fuser hands them to autograd. The one exception is deferred weight-gradient
  work (``delay_wgrad_compute`` / ``accumulate_into_main_grad``): those ops return None for the deferred
  parameters and hand their work to :meth:`~splitgrad.core.SplitModule.hand_over_wgrad` that writes them later, as the modules do.

A **fused op** (:class:`FusedOperation`) stands in for a run of consecutive basic ops in the forward or the
backward pass. It must fill every basic op's context exactly as the basic ops would, so that a forward fusion
composes with any backward fusion (or none). Fused ops are made by fusion functions ``list[op] -> list[op]``
(see :mod:`splitgrad.ops.fuser`); they are not ``nn.Module``\\ s and own no parameters.

Any :class:`FusibleOperation` (basic or composite, e.g. ``ops.Linear``) can be called on its own or grouped by
:class:`~splitgrad.ops.Sequential`; either way it runs through an :class:`~splitgrad.ops.fuser.OperationFuser`,
i.e. one autograd Function per run of consecutive ops.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

__all__ = ["BasicOperation", "FusedOperation", "FusibleOperation", "OperationContext", "ParamGrads"]

#: What ``op_backward`` returns for the parameters: one entry (or None) per :meth:`BasicOperation.op_parameters`.
ParamGrads = Sequence[torch.Tensor | None]


class OperationContext:
    """One basic op's state between its forward and its backward (one instance per op per forward).

    Ops keep tensors only through :meth:`save_for_backward` (the fuser passes them to autograd's
    ``save_for_backward``, so in-place changes are detected and memory is freed with the graph); plain Python
    values (flags, split sizes) may be set as attributes.

    Attributes:
        input_requires_grad: backward must return ``dx`` (some earlier op or the input needs a gradient).
        weight_requires_grad: some parameter of this op needs a gradient.
        saved_tensors: in backward, what the forward saved (in order).
        create_graph: in backward, whether it runs with ``create_graph=True``.
    """

    def __init__(self, input_requires_grad: bool = False, weight_requires_grad: bool = False) -> None:
        self.input_requires_grad = input_requires_grad
        self.weight_requires_grad = weight_requires_grad
        self.to_save: tuple[torch.Tensor | None, ...] = ()
        self.saved_tensors: tuple[torch.Tensor | None, ...] = ()
        self.create_graph = False

    @property
    def requires_grad(self) -> bool:
        """Whether this op takes part in backward at all (so whether to save anything)."""
        return self.input_requires_grad or self.weight_requires_grad

    def save_for_backward(self, *tensors: torch.Tensor | None) -> None:
        """Keep ``tensors`` for backward (replaces anything saved before in this forward)."""
        self.to_save = tensors


class FusibleOperation(nn.Module):
    """Anything :class:`~splitgrad.ops.Sequential` may group into one autograd Function.

    Subclasses say which basic ops they consist of (:meth:`basic_ops`) and how many extra inputs (e.g. split
    sizes) those consume. Calling the op runs it through a private single-op fuser.
    """

    def basic_ops(self) -> list[BasicOperation]:
        """The basic ops this operation consists of, in forward order."""
        raise NotImplementedError

    @property
    def num_extra_inputs(self) -> int:
        """How many extra inputs (after ``x``) a call consumes, e.g. ``GroupedLinear``'s split sizes."""
        return sum(op.num_extra_inputs for op in self.basic_ops())

    def pre_forward(self) -> None:
        """Called by the fuser before every forward (a composite op re-links its parameters here)."""

    def forward(self, x: torch.Tensor, *extra_inputs: Any) -> torch.Tensor:
        """Run this operation alone: ``x: (..., features_in)`` -> ``(..., features_out)``."""
        fuser = self.__dict__.get("_standalone_fuser")
        if fuser is None:
            from .fuser import OperationFuser, default_fusions

            fuser = OperationFuser([self], fusions=default_fusions())
            self.__dict__["_standalone_fuser"] = fuser
        return fuser(x, extra_inputs)

    def _describe(self) -> str:
        return f"ops.{type(self).__name__}({self.extra_repr()})"


class BasicOperation(FusibleOperation):
    """A unit op: ``op_forward`` / ``op_backward`` over an :class:`OperationContext`.

    Class attribute ``num_extra_inputs`` (default 0) says how many extra positional inputs ``op_forward``
    takes after ``x``.
    """

    num_extra_inputs: int = 0  # type: ignore[assignment]  # a plain class attribute on basic ops

    def basic_ops(self) -> list[BasicOperation]:
        return [self]

    def op_parameters(self) -> list[nn.Parameter]:
        """The parameters whose gradients ``op_backward`` returns, in that order (registration order)."""
        return [p for p in self._parameters.values() if p is not None]

    def op_forward(self, ctx: OperationContext, x: torch.Tensor, *extra_inputs: Any) -> torch.Tensor:
        """Compute the output; save what backward needs with ``ctx.save_for_backward`` when ``ctx.requires_grad``."""
        raise NotImplementedError

    def op_backward(self, ctx: OperationContext, dy: torch.Tensor) -> tuple[torch.Tensor | None, ParamGrads]:
        """Return ``(dx, param_grads)``; ``dx`` may be None when ``not ctx.input_requires_grad``."""
        raise NotImplementedError

    # The fuser drives basic and fused ops through the same two calls.
    def fuser_forward(
        self, ctxs: Sequence[OperationContext], x: torch.Tensor, extra_inputs: Sequence[tuple[Any, ...]]
    ) -> torch.Tensor:
        return self.op_forward(ctxs[0], x, *extra_inputs[0])

    def fuser_backward(
        self, ctxs: Sequence[OperationContext], dy: torch.Tensor
    ) -> tuple[torch.Tensor | None, list[ParamGrads]]:
        dx, grads = self.op_backward(ctxs[0], dy)
        return dx, [grads]


class FusedOperation:
    """Stands in for consecutive basic ops in the forward or the backward pass of a fuser.

    Subclasses implement :meth:`fuser_forward` (forward fusions) or :meth:`fuser_backward` (backward fusions).
    The contexts passed are those of :meth:`basic_ops`, in order; a fused forward must save into each of them
    what that basic op's own forward would, and a fused backward may read only that.

    Args:
        basic_ops: the ops it stands in for, in forward order (at least two).
    """

    def __init__(self, basic_ops: Sequence[BasicOperation]) -> None:
        if len(basic_ops) < 2:
            raise ValueError(f"{type(self).__name__} must wrap at least two basic ops, got {len(basic_ops)}")
        self._basic_ops: tuple[BasicOperation, ...] = tuple(basic_ops)

    def basic_ops(self) -> list[BasicOperation]:
        """The basic ops this fused op stands in for, in forward order."""
        return list(self._basic_ops)

    def fuser_forward(
        self, ctxs: Sequence[OperationContext], x: torch.Tensor, extra_inputs: Sequence[tuple[Any, ...]]
    ) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} is not a forward fusion")

    def fuser_backward(
        self, ctxs: Sequence[OperationContext], dy: torch.Tensor
    ) -> tuple[torch.Tensor | None, list[ParamGrads]]:
        raise NotImplementedError(f"{type(self).__name__} is not a backward fusion")

    def __repr__(self) -> str:
        inner = ", ".join(type(op).__name__ for op in self._basic_ops)
        return f"{type(self).__name__}({inner})"
