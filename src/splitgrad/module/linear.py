"""``splitgrad.Linear``: ``y = x @ W.T + b`` whose backward can defer the weight gradient."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..core import SplitModule, split_backward
from ..functional.init import linear_init_
from ._linear_wgrad import hand_over_linear_wgrad

__all__ = ["Linear"]


class _LinearFunction(torch.autograd.Function):
    """Autograd Function of :class:`Linear`; backward splits dgrad from wgrad through ``owner``.

    Shapes: ``x: (..., in)``, ``weight: (out, in)``, ``bias: (out,) | None`` -> ``y: (..., out)``.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, owner: Linear):  # type: ignore[override]
        ctx.owner = owner
        ctx.has_bias = bias is not None
        # Whether the module handles the wgrad itself is fixed at forward (a switch flipped before backward
        # cannot make autograd drop it); whether it is parked or run then is decided by the store at backward.
        ctx.split = owner.splits_wgrad()
        ctx.params = (owner.weight, owner.bias)
        ctx.save_for_backward(x, weight)
        return F.linear(x, weight, bias)

    @staticmethod
    @split_backward
    def backward(ctx, dy):  # type: ignore[override]
        x, weight = ctx.saved_tensors
        owner: Linear = ctx.owner
        dy2 = dy.reshape(-1, dy.shape[-1])
        x2 = x.reshape(-1, x.shape[-1])
        dx = dy2.mm(weight).view(x.shape) if ctx.needs_input_grad[0] else None

        dw, db = hand_over_linear_wgrad(owner, ctx, dy2, x2, ctx.needs_input_grad[1:3])
        return dx, dw, db, None


class Linear(SplitModule):
    """Drop-in ``torch.nn.Linear`` (same parameters, init and state_dict) with a splittable backward.

    Args:
        in_features: size of the last input dimension.
        out_features: size of the last output dimension.
        bias: learn an additive bias.
        delay_wgrad_compute: backward computes only the input gradient; the weight/bias gradient is parked as a
            task and computed by :meth:`backward_dw` (or by a :func:`splitgrad.capture_wgrad` bundle).
        fuse_wgrad_accumulation: add the weight gradient straight into ``weight.main_grad`` (the fp32 buffer of
            a data-parallel wrapper) with one addmm; ``weight.grad`` stays None. The bias gradient still goes
            to ``bias.grad``.
        params_dtype: parameter dtype (default: torch's default dtype).
        device: parameter device.

    Shapes: input ``(..., in_features)`` -> output ``(..., out_features)``.
    """

    def __init__(
        self,
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
        if in_features <= 0 or out_features <= 0:
            raise ValueError(f"Linear needs positive sizes, got {in_features=} {out_features=}")
        self.in_features = in_features
        self.out_features = out_features
        factory = {"dtype": params_dtype, "device": device}
        self.weight = nn.Parameter(torch.empty(out_features, in_features, **factory))
        self.bias = nn.Parameter(torch.empty(out_features, **factory)) if bias else None
        self.reset_parameters()
        self.init_split(
            delay_wgrad_compute=delay_wgrad_compute, fuse_wgrad_accumulation=fuse_wgrad_accumulation
        )

    def reset_parameters(self) -> None:
        """``torch.nn.Linear``'s initialisation, so seeded models match it exactly."""
        linear_init_(self.weight, self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x: (..., in_features)`` -> ``(..., out_features)``."""
        self._check_last_dim(x, self.in_features, "in_features")
        return self.apply_function(_LinearFunction, x, self.weight, self.bias, self)

    def wgrad_parameters(self) -> list[nn.Parameter]:
        return [self.weight] if self.bias is None else [self.weight, self.bias]

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
        )
