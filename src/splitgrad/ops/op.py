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
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .context import OperationContext, ParamGrads

if TYPE_CHECKING:
    from .fuser import FusionRegistry

__all__ = ["BasicOperation", "FusedOperation", "FusibleOperation", "OperationContext", "ParamGrads"]


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
            # Imported here: the fuser runs ops but never imports this module (one-way dependency).
            from .fuser import OperationFuser

            fuser = OperationFuser([self], fusions=self.standalone_fusions())
            self.__dict__["_standalone_fuser"] = fuser
        return fuser(x, extra_inputs)

    def standalone_fusions(self) -> FusionRegistry | None:
        """The fusions applied when this op is called on its own (default None: a single basic op has
        nothing to fuse with; composite ops such as ``ops.Linear`` return :func:`~splitgrad.ops.default_fusions`)."""
        return None

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
