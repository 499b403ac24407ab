"""``splitgrad.GroupedLinear``: one linear per group of rows (MoE experts) with a splittable backward."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ..core import SplitModule, split_backward
from ..functional.init import linear_init_
from ..functional.split_sizes import check_split_sizes
from ..functional.wgrad import bias_wgrad, check_targets, linear_wgrad, write_linear_wgrad
from ._layer_setup import check_positive_sizes, register_optional_parameter
from ._linear_wgrad import route_wgrad_at_forward

__all__ = ["GroupedLinear"]


class _GroupedLinearFunction(torch.autograd.Function):
    """Autograd Function of :class:`GroupedLinear`.

    Shapes: ``x: (tokens, in)`` split by rows into ``m_splits``; ``weights[i]: (out, in)``,
    ``biases[i]: (out,)`` -> ``y: (tokens, out)`` whose row block ``i`` is ``x_i @ weights[i].T + biases[i]``.
    Every GEMM reads and writes contiguous row slices of one input/output buffer (no concatenation).
    """

    @staticmethod
    def forward(ctx, x, m_splits: list[int], owner: GroupedLinear, *params):  # type: ignore[override]
        n = owner.num_gemms
        weights, biases = params[:n], (params[n:] if len(params) > n else (None,) * n)
        ctx.m_splits, ctx.n = m_splits, n
        has_bias = len(params) > n
        route_wgrad_at_forward(
            ctx, owner, (*owner.weights, *(owner.biases if has_bias else ())), has_bias=has_bias
        )
        ctx.save_for_backward(x, *weights)
        y = x.new_empty(x.shape[0], owner.out_features)
        for xi, yi, w, b in zip(torch.split(x, m_splits), torch.split(y, m_splits), weights, biases):
            if xi.shape[0] == 0:
                continue
            # The ops F.linear dispatches to for 2-D inputs, written in place: bitwise equal to it.
            if b is None:
                torch.mm(xi, w.t(), out=yi)
            else:
                torch.addmm(b, xi, w.t(), out=yi)
        return y

    @staticmethod
    @split_backward
    def backward(ctx, dy):  # type: ignore[override]
        x, *weights = ctx.saved_tensors
        owner: GroupedLinear = ctx.owner
        n, m_splits = ctx.n, ctx.m_splits
        need = ctx.needs_input_grad[3:]
        dy = dy.contiguous()

        dx = None
        if ctx.needs_input_grad[0]:
            dx = x.new_empty(x.shape)
            for dyi, dxi, w in zip(torch.split(dy, m_splits), torch.split(dx, m_splits), weights):
                if dyi.shape[0] != 0:
                    torch.mm(dyi, w, out=dxi)

        def gradients(mask: tuple[bool, ...]) -> list[torch.Tensor | None]:
            dws, dbs = [], []
            for i, (dyi, xi) in enumerate(zip(torch.split(dy, m_splits), torch.split(x, m_splits))):
                dws.append(linear_wgrad(dyi, xi) if mask[i] else None)
                if ctx.has_bias:
                    dbs.append(bias_wgrad(dyi) if mask[n + i] else None)
            return dws + dbs

        def write(mask: tuple[bool, ...]) -> None:
            biases = mask[n:] if ctx.has_bias else (False,) * n
            owner._write_wgrad(dy, x, m_splits, want_w=mask[:n], want_b=biases)

        grads = owner.hand_over_wgrad(
            ctx.params, need, split=ctx.split, gradients=gradients, write=write,
            saved=(dy, x), create_graph=ctx.create_graph,
        )  # fmt: skip
        return (dx, None, None, *grads)


class GroupedLinear(SplitModule):
    """``num_gemms`` independent linears applied to consecutive row groups (TE's MoE expert layer).

    Parameters are ``weight0 .. weight{n-1}`` ``(out_features, in_features)`` and ``bias0 ..`` ``(out,)``.
    One :meth:`backward_dw` completes every group of one backward. Empty groups are allowed; their
    gradients are zeros (as with plain autograd), accumulated like any other.

    Args:
        num_gemms: number of groups (experts).
        in_features: size of the last input dimension.
        out_features: size of the last output dimension.
        bias: learn a bias per group.
        delay_wgrad_compute: park every group's weight gradient as one task for :meth:`backward_dw`.
        fuse_wgrad_accumulation: add each ``weight{i}`` gradient into ``weight{i}.main_grad``.
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
        factory = {"dtype": params_dtype, "device": device}
        for i in range(num_gemms):
            self.register_parameter(
                f"weight{i}", nn.Parameter(torch.empty(out_features, in_features, **factory))
            )
            register_optional_parameter(self, f"bias{i}", bias, (out_features,), factory)
        self.reset_parameters()
        self.init_split(
            delay_wgrad_compute=delay_wgrad_compute, fuse_wgrad_accumulation=fuse_wgrad_accumulation
        )

    @property
    def weights(self) -> list[nn.Parameter]:
        """``[weight0, ..., weight{n-1}]``."""
        return [getattr(self, f"weight{i}") for i in range(self.num_gemms)]

    @property
    def biases(self) -> list[nn.Parameter | None]:
        """``[bias0, ..., bias{n-1}]`` (Nones without bias)."""
        return [getattr(self, f"bias{i}") for i in range(self.num_gemms)]

    def reset_parameters(self) -> None:
        """Each group initialised like a ``torch.nn.Linear``."""
        for w, b in zip(self.weights, self.biases):
            linear_init_(w, b)

    def forward(self, x: torch.Tensor, m_splits: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """``x: (..., in_features)`` with rows grouped by ``m_splits`` -> ``(..., out_features)``.

        ``m_splits`` may be a sequence of ints or a 1-D integer tensor (read once on the host); floats
        (even integral ones), bools, nested or 2-D sizes raise ``ValueError`` showing the values, as does a
        length other than ``num_gemms`` or a sum other than the number of rows. An input on another device
        than the weights raises ``RuntimeError`` naming both devices. Works on the ``"meta"`` device.
        """
        splits = self._check_splits(x, m_splits)
        params = [*self.weights, *(self.biases if self.use_bias else ())]
        x2 = x.reshape(-1, self.in_features)
        y = self.apply_function(_GroupedLinearFunction, x2, splits, self, *params)
        return y.view(*x.shape[:-1], self.out_features)

    def _check_splits(self, x: torch.Tensor, m_splits: Sequence[int] | torch.Tensor) -> list[int]:
        self._check_last_dim(x, self.in_features, "in_features")
        return check_split_sizes(
            self._describe(), "m_splits", m_splits, self.num_gemms, x.numel() // self.in_features
        )

    def wgrad_parameters(self) -> list[nn.Parameter]:
        # Registration order (weight0, bias0, weight1, ...), the order named_parameters() reports.
        return list(self.parameters())

    def _write_wgrad(
        self,
        dy: torch.Tensor,
        x: torch.Tensor,
        m_splits: list[int],
        *,
        want_w: tuple[bool, ...],
        want_b: tuple[bool, ...],
    ) -> None:
        """Write every group's gradients for ``dy: (tokens, out)`` and ``x: (tokens, in)``."""
        owner, fused = self._describe(), self.fuse_wgrad_accumulation
        # Every group is checked before any is written: a failed task writes nothing and can be retried.
        targets = [(w, want_w[i], f"weight{i}", fused) for i, w in enumerate(self.weights)]
        targets += [(b, want_b[i], f"bias{i}", False) for i, b in enumerate(self.biases)]
        check_targets(targets, owner=owner, flag="fuse_wgrad_accumulation")
        groups = zip(torch.split(dy, m_splits), torch.split(x, m_splits), self.weights, self.biases)
        for i, (dyi, xi, w, b) in enumerate(groups):
            write_linear_wgrad(
                w, b, dyi, xi, want_w=want_w[i], want_b=want_b[i], fused=fused, owner=owner, name=f"weight{i}"
            )

    def extra_repr(self) -> str:
        return (
            f"num_gemms={self.num_gemms}, in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.use_bias}"
        )
