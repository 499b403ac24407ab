"""``ops.BasicLinear``: ``y = x @ W.T`` (no bias) whose weight gradient can be deferred."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ...functional.init import linear_init_
from ...functional.split_sizes import check_positive_sizes
from ...functional.wgrad import linear_wgrad, write_linear_wgrad
from ..op import OperationContext, ParamGrads
from ._split_op import SplitOperation, split_repr

__all__ = ["BasicLinear"]


class BasicLinear(SplitOperation):
    """Matrix multiply by ``weight: (out_features, in_features)``, with TE's split-backward contract.

    Modes (decided at forward, as for :class:`splitgrad.Linear`):

    * immediate: ``op_backward`` returns ``dW`` to autograd;
    * ``delay_wgrad_compute=True``: ``op_backward`` returns only ``dx`` and parks one task per backward that
      :meth:`backward_dw` (or :func:`splitgrad.backward_dw` / a capture bundle) runs;
    * ``accumulate_into_main_grad=True`` without delay: the task runs at once inside backward.

    In the last two modes ``dW`` is *accumulated* into ``weight.grad`` (or added into ``weight.main_grad``,
    ``weight.grad`` staying None), ``weight.skip_backward_post_hook`` is True, and the wgrad hooks fire after
    the gradient is written.

    Args:
        in_features: size of the last input dimension.
        out_features: size of the last output dimension.
        delay_wgrad_compute: defer the weight gradient to :meth:`backward_dw`.
        accumulate_into_main_grad: add the weight gradient into ``weight.main_grad`` (TE's ops name for the
            modules' ``fuse_wgrad_accumulation``).
        dtype: parameter dtype (default: torch's default dtype).
        device: parameter device.

    Shapes: ``x: (..., in_features)`` -> ``(..., out_features)``.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        delay_wgrad_compute: bool = False,
        accumulate_into_main_grad: bool = False,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        check_positive_sizes("ops.BasicLinear", in_features=in_features, out_features=out_features)
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype, device=device))
        self.finish_init(
            delay_wgrad_compute=delay_wgrad_compute, accumulate_into_main_grad=accumulate_into_main_grad
        )

    def reset_parameters(self) -> None:
        """``torch.nn.Linear``'s weight initialisation."""
        linear_init_(self.weight)

    def wgrad_parameters(self) -> list[nn.Parameter]:
        return [self.weight]

    # -- op contract ----------------------------------------------------------------------------------------
    def prepare_forward(self, ctx: OperationContext, x: torch.Tensor) -> None:
        """Validate ``x`` and save what :meth:`op_backward` needs (fused forwards call this too)."""
        self._check_last_dim(x, self.in_features, "in_features")
        # Decided at forward so that flipping the switch between forward and backward cannot mix modes.
        ctx.split = ctx.weight_requires_grad and self.splits_wgrad()
        ctx.params = (self.weight,)
        if ctx.requires_grad:
            ctx.save_for_backward(
                x if ctx.weight_requires_grad else None, self.weight if ctx.input_requires_grad else None
            )

    def op_forward(self, ctx: OperationContext, x: torch.Tensor) -> torch.Tensor:
        self.prepare_forward(ctx, x)
        return F.linear(x, self.weight)

    def op_backward(self, ctx: OperationContext, dy: torch.Tensor) -> tuple[torch.Tensor | None, ParamGrads]:
        x, weight = ctx.saved_tensors
        dy2 = dy.reshape(-1, self.out_features)
        dx = dy2.mm(weight).view(*dy.shape[:-1], self.in_features) if ctx.input_requires_grad else None
        if not ctx.weight_requires_grad:
            return dx, [None]
        x2 = x.reshape(-1, self.in_features)

        def write(mask: tuple[bool, ...]) -> None:
            write_linear_wgrad(
                self.weight, None, dy2, x2, want_w=mask[0], want_b=False, fused=self.fuse_wgrad_accumulation,
                owner=self._describe(), name="weight", flag="accumulate_into_main_grad",
            )  # fmt: skip

        grads = self.hand_over_wgrad(
            ctx.params, (True,), split=ctx.split, gradients=lambda mask: [linear_wgrad(dy2, x2)], write=write,
            saved=(dy2, x2), create_graph=ctx.create_graph,
        )  # fmt: skip
        return dx, grads

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {split_repr(self)}"
