"""What the fuser and the ops share: the per-forward :class:`OperationContext`, and the two shapes of op the
fuser drives (structural types, so :mod:`~splitgrad.ops.fuser` needs nothing from :mod:`~splitgrad.ops.op`
and the op contract may call the fuser without an import cycle)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

__all__ = ["Fusible", "OperationContext", "ParamGrads", "PlanOp"]

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


@runtime_checkable
class PlanOp(Protocol):
    """A step of a fusion plan: a basic op (one context) or a fused op (one context per basic op it covers)."""

    def basic_ops(self) -> list[Any]: ...

    def fuser_forward(
        self, ctxs: Sequence[OperationContext], x: torch.Tensor, extra_inputs: Sequence[tuple[Any, ...]]
    ) -> torch.Tensor: ...

    def fuser_backward(
        self, ctxs: Sequence[OperationContext], dy: torch.Tensor
    ) -> tuple[torch.Tensor | None, list[ParamGrads]]: ...


class Fusible(Protocol):
    """What a fuser asks of the ops it is built from (basic or composite)."""

    num_extra_inputs: int

    def basic_ops(self) -> list[Any]: ...

    def pre_forward(self) -> None: ...

    def op_parameters(self) -> list[nn.Parameter]: ...
