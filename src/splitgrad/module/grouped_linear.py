"""``splitgrad.GroupedLinear``: one linear per group of rows (MoE experts) with a splittable backward."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ..core import SplitModule, split_backward
from ..functional.grouped_gemm import group_offsets, grouped_dgrad, grouped_forward
from ..functional.grouped_layout import (
    grouped_biases,
    grouped_pairs,
    grouped_params_of,
    register_grouped_parameters,
)
from ..functional.grouped_wgrad import GroupedParams, grouped_gradients, write_grouped_wgrad
from ..functional.init import linear_init_
from ..functional.split_sizes import check_positive_sizes, check_split_sizes
from ._linear_wgrad import route_wgrad_at_forward

__all__ = ["GroupedLinear"]


class _GroupedLinearFunction(torch.autograd.Function):
    """Autograd Function of :class:`GroupedLinear`.

    Shapes: ``x: (tokens, in)`` split by rows into ``m_splits``; the weight(s) and bias(es) as
    :class:`~splitgrad.functional.grouped_wgrad.GroupedParams` lays them out (one ``(groups, out, in)`` tensor or
    one ``(out, in)`` per group) -> ``y: (tokens, out)`` whose row block ``i`` is ``x_i @ W_i.T + b_i``. The
    grouped GEMM picks ``grouped_mm`` or the per-group loop (:mod:`splitgrad.functional.grouped_gemm`).
    """

    @staticmethod
    def forward(ctx, x, m_splits: list[int], owner: GroupedLinear, *params):  # type: ignore[override]
        layout = owner.grouped_params(params)
        ctx.m_splits, ctx.layout = m_splits, layout
        route_wgrad_at_forward(
            ctx, owner, tuple(owner.grouped_params().tensors), has_bias=layout.bias is not None
        )
        ctx.save_for_backward(x, *layout.weights)
        # grouped_mm's offsets, once per call (only a 3-D weight can take that path).
        ctx.offs = group_offsets(m_splits, x.device) if isinstance(layout.weight, torch.Tensor) else None
        return grouped_forward(x, layout.weight, m_splits, bias=layout.bias, offs=ctx.offs)

    @staticmethod
    @split_backward
    def backward(ctx, dy):  # type: ignore[override]
        x, *weights = ctx.saved_tensors
        owner: GroupedLinear = ctx.owner
        m_splits = ctx.m_splits
        weight = weights[0] if isinstance(ctx.layout.weight, torch.Tensor) else weights
        dy = dy.contiguous()  # grouped_mm refuses broadcast gradients (e.g. of a .sum())
        offs = ctx.offs
        dx = grouped_dgrad(dy, weight, m_splits, offs=offs) if ctx.needs_input_grad[0] else None

        def gradients(mask: tuple[bool, ...]) -> list[torch.Tensor | None]:
            return grouped_gradients(ctx.layout, dy, x, m_splits, mask, offs)

        def write(mask: tuple[bool, ...]) -> None:
            owner._write_wgrad(dy, x, m_splits, mask, offs)

        grads = owner.hand_over_wgrad(
            ctx.params, ctx.needs_input_grad[3:], split=ctx.split, gradients=gradients, write=write,
            saved=(dy, x), create_graph=ctx.create_graph,
        )  # fmt: skip
        return (dx, None, None, *grads)


class GroupedLinear(SplitModule):
    """``num_gemms`` independent linears applied to consecutive row groups (TE's MoE expert layer).

    Parameters, as TE names them: ``weight0 .. weight{n-1}`` ``(out_features, in_features)`` and ``bias0 ..``
    ``(out_features,)``; with ``single_grouped_weight=True`` one ``weight`` ``(num_gemms, out_features,
    in_features)``, with ``single_grouped_bias=True`` one ``bias`` ``(num_gemms, out_features)``.
    :func:`~splitgrad.functional.grouped_layout.convert_grouped_state_dict` converts checkpoints between the
    layouts. One :meth:`backward_dw` completes every group of one backward. Empty groups are allowed; their
    gradients are zeros (as with plain autograd), accumulated like any other. The GEMMs run torch's
    ``grouped_mm`` where it applies (one 3-D weight, float32/bfloat16/float16, 16-byte strides) and a
    per-group loop elsewhere; fused accumulation always adds into ``main_grad`` group by group, without a
    weight-sized temporary (see :mod:`splitgrad.functional.grouped_gemm`).

    Args:
        num_gemms: number of groups (experts).
        in_features: size of the last input dimension.
        out_features: size of the last output dimension.
        bias: learn a bias per group.
        single_grouped_weight: one 3-D ``weight`` parameter instead of ``weight0 ..``.
        single_grouped_bias: one 2-D ``bias`` parameter instead of ``bias0 ..`` (no effect without ``bias``).
        delay_wgrad_compute: park every group's weight gradient as one task for :meth:`backward_dw`.
        fuse_wgrad_accumulation: add the weight gradient(s) into ``main_grad`` (same shape as the weight).
        params_dtype: parameter dtype (default: torch's default dtype).
        device: parameter device.

    Shapes: ``forward(x, m_splits)`` with ``x: (..., in_features)`` whose flattened rows are grouped by
    ``m_splits`` (``sum(m_splits)`` rows) -> ``(..., out_features)``.
    """

    def __init__(
        self,
        num_gemms: int,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        single_grouped_weight: bool = False,
        single_grouped_bias: bool = False,
        delay_wgrad_compute: bool = False,
        fuse_wgrad_accumulation: bool = False,
        params_dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        check_positive_sizes(
            "GroupedLinear", num_gemms=num_gemms, in_features=in_features, out_features=out_features
        )
        self.num_gemms = num_gemms
        self.in_features = in_features
        self.out_features = out_features
        self.use_bias = bool(bias)
        self.single_grouped_weight = bool(single_grouped_weight)
        self.single_grouped_bias = bool(single_grouped_bias) and self.use_bias
        register_grouped_parameters(
            self, num_gemms, (out_features, in_features), bias=self.use_bias,
            single_weight=self.single_grouped_weight, single_bias=self.single_grouped_bias,
            factory={"dtype": params_dtype, "device": device}, absent_as_none=True,
        )  # fmt: skip
        self.reset_parameters()
        self.init_split(
            delay_wgrad_compute=delay_wgrad_compute, fuse_wgrad_accumulation=fuse_wgrad_accumulation
        )

    @property
    def weights(self) -> list[nn.Parameter]:
        """The weight parameter(s): ``[weight]`` with ``single_grouped_weight``, else ``[weight0, ..]``."""
        return self.grouped_params().weights

    @property
    def biases(self) -> list[nn.Parameter | None]:
        """Each group's bias: views of ``bias`` with ``single_grouped_bias``, ``[bias0, ..]``, or Nones."""
        return grouped_biases(self.grouped_params(), self.num_gemms)

    def grouped_params(self, tensors: Sequence[torch.Tensor] | None = None) -> GroupedParams:
        """The layer's parameters (or ``tensors`` standing in for them, in the same order) as a layout."""
        return grouped_params_of(
            self, self.num_gemms, tensors, single_weight=self.single_grouped_weight,
            single_bias=self.single_grouped_bias, bias=self.use_bias,
        )  # fmt: skip

    def reset_parameters(self) -> None:
        """Each group initialised like a ``torch.nn.Linear``, group by group in either layout (so one seed gives
        the same values in both)."""
        with torch.no_grad():
            for w, b in grouped_pairs(self.grouped_params(), self.num_gemms):
                linear_init_(w, b)

    def forward(self, x: torch.Tensor, m_splits: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """``x: (..., in_features)`` with rows grouped by ``m_splits`` -> ``(..., out_features)``.

        ``m_splits`` may be a sequence of ints or a 1-D integer tensor (read once on the host); floats
        (even integral ones), bools, nested or 2-D sizes raise ``ValueError`` showing the values, as does a
        length other than ``num_gemms`` or a sum other than the number of rows. An input on another device
        than the weights raises ``RuntimeError`` naming both devices. Works on the ``"meta"`` device.
        """
        splits = self._check_splits(x, m_splits)
        x2 = x.reshape(-1, self.in_features)
        y = self.apply_function(_GroupedLinearFunction, x2, splits, self, *self.grouped_params().tensors)
        return y.view(*x.shape[:-1], self.out_features)

    def _check_splits(self, x: torch.Tensor, m_splits: Sequence[int] | torch.Tensor) -> list[int]:
        self._check_last_dim(x, self.in_features, "in_features")
        return check_split_sizes(
            self._describe, "m_splits", m_splits, self.num_gemms, x.numel() // self.in_features
        )

    def wgrad_parameters(self) -> list[nn.Parameter]:
        # Registration order (weight0, bias0, weight1, ... or weight, bias), the order named_parameters() reports.
        return list(self.parameters())

    def _write_wgrad(
        self,
        dy: torch.Tensor,
        x: torch.Tensor,
        m_splits: list[int],
        mask: tuple[bool, ...],
        offs: torch.Tensor | None = None,
    ) -> None:
        """Write the masked gradients (:meth:`grouped_params` order) for ``dy: (tokens, out)``, ``x: (tokens, in)``."""
        fused, owner = self.fuse_wgrad_accumulation, self._describe()
        write_grouped_wgrad(self.grouped_params(), dy, x, m_splits, mask, fused=fused, owner=owner, offs=offs)

    def extra_repr(self) -> str:
        text = (
            f"num_gemms={self.num_gemms}, in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.use_bias}"
        )
        if self.single_grouped_weight or self.single_grouped_bias:
            text += f", single_grouped_weight={self.single_grouped_weight}, single_grouped_bias={self.single_grouped_bias}"
        return text
