"""``ops.GroupedLinear``: one linear per group of consecutive tokens (MoE experts), deferrable wgrad."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ...functional.init import linear_init_
from ...functional.split_sizes import check_split_sizes
from ...functional.wgrad import bias_wgrad, check_targets, linear_wgrad, write_linear_wgrad
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
    return check_split_sizes(op._describe(), "split_sizes", split_sizes, num_groups, tokens)


class GroupedLinear(SplitOperation):
    """``y_g = x_g @ weight{g}.T + bias{g}`` for consecutive row blocks ``x_g`` of ``x`` (sizes per call).

    Called as ``op(x, split_sizes)``; inside :class:`~splitgrad.ops.Sequential` the split sizes are an extra
    input (``seq(x, split_sizes)``). Weights *and* biases are deferred together (one task per backward covering
    every group), as in the :class:`splitgrad.GroupedLinear` module; with ``accumulate_into_main_grad`` the
    weight gradients are added into ``weight{g}.main_grad`` and the bias gradients accumulate into ``.grad``.

    Args:
        num_groups: number of groups (experts).
        in_features: size of the last input dimension.
        out_features: size of the last output dimension.
        bias: learn a bias per group.
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
        delay_wgrad_compute: bool = False,
        accumulate_into_main_grad: bool = False,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        if num_groups <= 0 or in_features <= 0 or out_features <= 0:
            raise ValueError(
                f"ops.GroupedLinear needs positive sizes, got {num_groups=} {in_features=} {out_features=}"
            )
        self.num_groups = num_groups
        self.in_features = in_features
        self.out_features = out_features
        self.use_bias = bias
        factory = {"dtype": dtype, "device": device}
        for g in range(num_groups):
            self.register_parameter(
                f"weight{g}", nn.Parameter(torch.empty(out_features, in_features, **factory))
            )
        if bias:
            for g in range(num_groups):
                self.register_parameter(f"bias{g}", nn.Parameter(torch.empty(out_features, **factory)))
        self.finish_init(
            delay_wgrad_compute=delay_wgrad_compute, accumulate_into_main_grad=accumulate_into_main_grad
        )

    def weights(self) -> list[nn.Parameter]:
        return [getattr(self, f"weight{g}") for g in range(self.num_groups)]

    def biases(self) -> list[nn.Parameter | None]:
        return [getattr(self, f"bias{g}") if self.use_bias else None for g in range(self.num_groups)]

    def reset_parameters(self) -> None:
        """``torch.nn.Linear``'s initialisation, group by group."""
        for w, b in zip(self.weights(), self.biases()):
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
        ctx.sizes = sizes
        ctx.split = ctx.weight_requires_grad and self.splits_wgrad()
        ctx.params = tuple(self.op_parameters())
        ctx.lead = tuple(x.shape[:-1])
        if ctx.requires_grad:
            ctx.save_for_backward(x2 if ctx.weight_requires_grad else None, *self.weights())
        y = x2.new_empty(x2.shape[0], self.out_features)
        for xg, yg, w, b in zip(x2.split(sizes), y.split(sizes), self.weights(), self.biases()):
            # Writing each group's GEMM straight into its rows of y avoids a concatenation copy.
            if b is None:
                torch.mm(xg, w.t(), out=yg)
            else:
                torch.addmm(b, xg, w.t(), out=yg)
        return y.view(*ctx.lead, self.out_features)

    def op_backward(self, ctx: OperationContext, dy: torch.Tensor) -> tuple[torch.Tensor | None, ParamGrads]:
        x2, *weights = ctx.saved_tensors
        sizes: list[int] = ctx.sizes
        dy2 = dy.reshape(-1, self.out_features)
        dx = None
        if ctx.input_requires_grad:
            dx2 = dy2.new_empty(dy2.shape[0], self.in_features)
            for dyg, dxg, w in zip(dy2.split(sizes), dx2.split(sizes), weights):
                torch.mm(dyg, w, out=dxg)
            dx = dx2.view(*ctx.lead, self.in_features)
        if not ctx.weight_requires_grad:
            return dx, None
        n = self.num_groups

        def gradients(mask: tuple[bool, ...]) -> list[torch.Tensor | None]:
            dys, xs = dy2.split(sizes), x2.split(sizes)
            dws = [linear_wgrad(dys[g], xs[g]) if mask[g] else None for g in range(n)]
            dbs = [bias_wgrad(dys[g]) if mask[n + g] else None for g in range(n)] if self.use_bias else []
            return dws + dbs

        def write(mask: tuple[bool, ...]) -> None:
            self._write_wgrad(dy2, x2, sizes, mask)

        grads = self.hand_over_wgrad(
            ctx.params, [p.requires_grad for p in ctx.params], split=ctx.split, gradients=gradients,
            write=write, saved=(dy2, x2), create_graph=ctx.create_graph,
        )  # fmt: skip
        return dx, grads

    def _write_wgrad(
        self, dy2: torch.Tensor, x2: torch.Tensor, sizes: list[int], mask: tuple[bool, ...]
    ) -> None:
        """Write the masked gradients (weights, then biases, as :meth:`op_parameters`) of every group."""
        owner, n, fused = self._describe(), self.num_groups, self.fuse_wgrad_accumulation
        want_b = mask[n:] if self.use_bias else (False,) * n
        # Every group is checked before any is written: a failed task writes nothing and can be retried.
        targets = [(w, mask[g], f"weight{g}", fused) for g, w in enumerate(self.weights())]
        targets += [(b, want_b[g], f"bias{g}", False) for g, b in enumerate(self.biases())]
        check_targets(targets, owner=owner, flag="accumulate_into_main_grad")
        groups = zip(dy2.split(sizes), x2.split(sizes), self.weights(), self.biases())
        for g, (dyg, xg, w, b) in enumerate(groups):
            write_linear_wgrad(
                w, b, dyg, xg, want_w=mask[g], want_b=want_b[g], fused=fused, owner=owner, name=f"weight{g}",
                flag="accumulate_into_main_grad",
            )  # fmt: skip

    def extra_repr(self) -> str:
        return (
            f"num_groups={self.num_groups}, in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.use_bias}, {split_repr(self)}"
        )
