"""``ops.GroupedLinear``: one linear per group of consecutive tokens (MoE experts), deferrable wgrad."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ...functional.grouped_gemm import grouped_dgrad, grouped_forward
from ...functional.grouped_layout import (
    grouped_biases,
    grouped_pairs,
    grouped_params_of,
    register_grouped_parameters,
)
from ...functional.grouped_wgrad import GroupedParams, grouped_gradients, write_grouped_wgrad
from ...functional.init import linear_init_
from ...functional.split_sizes import check_positive_sizes, check_split_sizes
from ..op import BasicOperation, OperationContext, ParamGrads
from ._split_op import SplitOperation, split_repr

__all__ = ["GroupedLinear", "as_split_sizes"]


def as_split_sizes(
    op: BasicOperation, split_sizes: Sequence[int] | torch.Tensor, num_groups: int, tokens: int
) -> list[int]:
    """``split_sizes`` (ints or an integer tensor) as a validated list of ``num_groups`` sizes summing to ``tokens``.

    Floats (even integral ones), bools, nested or 2-D sizes are refused, never truncated.

    Raises:
        ValueError: naming ``op`` and the offending sizes.
    """
    return check_split_sizes(op._describe, "split_sizes", split_sizes, num_groups, tokens)


class GroupedLinear(SplitOperation):
    """``y_g = x_g @ W_g.T + b_g`` for consecutive row blocks ``x_g`` of ``x`` (sizes per call).

    Called as ``op(x, split_sizes)``; inside :class:`~splitgrad.ops.Sequential` the split sizes are an extra
    input (``seq(x, split_sizes)``). Parameters: ``weight0 ..`` ``(out, in)`` then ``bias0 ..`` ``(out,)``, or
    (TE's ``single_grouped_weight`` / ``single_grouped_bias``) one ``weight`` ``(num_groups, out, in)`` and
    one ``bias`` ``(num_groups, out)``; :func:`~splitgrad.functional.grouped_layout.convert_grouped_state_dict`
    converts checkpoints between the layouts. Weights *and* biases are deferred together (one task per
    backward covering every group), as in the :class:`splitgrad.GroupedLinear` module; with
    ``accumulate_into_main_grad`` the weight gradients are added into ``main_grad`` (same shape as each weight,
    group by group, no weight-sized temporary) and the bias gradients accumulate into ``.grad``.

    Args:
        num_groups: number of groups (experts).
        in_features: size of the last input dimension.
        out_features: size of the last output dimension.
        bias: learn a bias per group.
        single_grouped_weight: one 3-D ``weight`` parameter instead of ``weight0 ..``.
        single_grouped_bias: one 2-D ``bias`` parameter instead of ``bias0 ..`` (no effect without ``bias``).
        delay_wgrad_compute: defer the weight/bias gradients to :meth:`backward_dw`.
        accumulate_into_main_grad: add weight gradients into ``main_grad`` (``.grad`` stays None).
        dtype: parameter dtype (default: torch's default dtype).
        device: parameter device.

    Shapes: ``x: (tokens, in_features)`` (leading dimensions are flattened into tokens), ``split_sizes``:
    ``num_groups`` ints summing to tokens -> ``(..., out_features)``.
    """

    num_extra_inputs = 1

    def __init__(
        self,
        num_groups: int,
        in_features: int,
        out_features: int,
        *,
        bias: bool = True,
        single_grouped_weight: bool = False,
        single_grouped_bias: bool = False,
        delay_wgrad_compute: bool = False,
        accumulate_into_main_grad: bool = False,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        check_positive_sizes(
            "ops.GroupedLinear", num_groups=num_groups, in_features=in_features, out_features=out_features
        )
        self.num_groups = num_groups
        self.in_features = in_features
        self.out_features = out_features
        self.use_bias = bias
        self.single_grouped_weight = bool(single_grouped_weight)
        self.single_grouped_bias = bool(single_grouped_bias) and bool(bias)
        register_grouped_parameters(
            self, num_groups, (out_features, in_features), bias=bias, single_weight=self.single_grouped_weight,
            single_bias=self.single_grouped_bias, factory={"dtype": dtype, "device": device}, interleave=False,
        )  # fmt: skip
        self.finish_init(
            delay_wgrad_compute=delay_wgrad_compute, accumulate_into_main_grad=accumulate_into_main_grad
        )

    def grouped_params(self, tensors: list[torch.Tensor] | None = None) -> GroupedParams:
        """The op's parameters (or ``tensors`` standing in for them, in the same order) as a layout."""
        return grouped_params_of(
            self, self.num_groups, tensors, single_weight=self.single_grouped_weight,
            single_bias=self.single_grouped_bias, bias=self.use_bias,
        )  # fmt: skip

    def weights(self) -> list[nn.Parameter]:
        """The weight parameter(s): ``[weight]`` or ``[weight0, ..]``."""
        return self.grouped_params().weights

    def biases(self) -> list[nn.Parameter | torch.Tensor | None]:
        """Each group's bias: ``[bias0, ..]``, views of the single ``bias``, or Nones."""
        return grouped_biases(self.grouped_params(), self.num_groups)

    def reset_parameters(self) -> None:
        """``torch.nn.Linear``'s initialisation, group by group (one seed gives both layouts the same values)."""
        with torch.no_grad():
            for w, b in grouped_pairs(self.grouped_params(), self.num_groups):
                linear_init_(w, b)

    def wgrad_parameters(self) -> list[nn.Parameter]:
        return self.op_parameters()

    # -- op contract ----------------------------------------------------------------------------------------
    def op_forward(
        self, ctx: OperationContext, x: torch.Tensor, split_sizes: Sequence[int] | torch.Tensor
    ) -> torch.Tensor:
        if x.dim() == 0 or x.shape[-1] != self.in_features:
            raise ValueError(
                f"{self._describe()}: input's last dimension must be in_features={self.in_features}, "
                f"got input shape {tuple(x.shape)}"
            )
        self._check_same_device(x, self.op_parameters())
        x2 = x.reshape(-1, self.in_features)
        sizes = as_split_sizes(self, split_sizes, self.num_groups, x2.shape[0])
        layout = self.grouped_params()
        ctx.sizes = sizes
        ctx.split = ctx.weight_requires_grad and self.splits_wgrad()
        ctx.params = tuple(layout.tensors)
        ctx.lead = tuple(x.shape[:-1])
        if ctx.requires_grad:
            ctx.save_for_backward(x2 if ctx.weight_requires_grad else None, *layout.weights)
        y = grouped_forward(x2, layout.weight, sizes, bias=layout.bias)
        return y.view(*ctx.lead, self.out_features)

    def op_backward(self, ctx: OperationContext, dy: torch.Tensor) -> tuple[torch.Tensor | None, ParamGrads]:
        x2, *weights = ctx.saved_tensors
        sizes: list[int] = ctx.sizes
        # Contiguous: grouped_mm refuses broadcast gradients (e.g. of a .sum()).
        dy2 = dy.reshape(-1, self.out_features).contiguous()
        dx = None
        if ctx.input_requires_grad:
            weight = weights[0] if self.single_grouped_weight else weights
            dx = grouped_dgrad(dy2, weight, sizes).view(*ctx.lead, self.in_features)
        if not ctx.weight_requires_grad:
            return dx, None
        layout = self.grouped_params()

        def gradients(mask: tuple[bool, ...]) -> list[torch.Tensor | None]:
            return grouped_gradients(layout, dy2, x2, sizes, mask)

        def write(mask: tuple[bool, ...]) -> None:
            write_grouped_wgrad(
                self.grouped_params(), dy2, x2, sizes, mask, fused=self.fuse_wgrad_accumulation,
                owner=self._describe(), flag="accumulate_into_main_grad",
            )  # fmt: skip

        grads = self.hand_over_wgrad(
            ctx.params, [p.requires_grad for p in ctx.params], split=ctx.split, gradients=gradients,
            write=write, saved=(dy2, x2), create_graph=ctx.create_graph,
        )  # fmt: skip
        return dx, grads

    def extra_repr(self) -> str:
        single = ""
        if self.single_grouped_weight or self.single_grouped_bias:
            single = f"single_grouped_weight={self.single_grouped_weight}, single_grouped_bias={self.single_grouped_bias}, "
        return (
            f"num_groups={self.num_groups}, in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.use_bias}, {single}{split_repr(self)}"
        )
