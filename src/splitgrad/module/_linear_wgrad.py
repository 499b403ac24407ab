"""The weight-gradient routing glue of the modules' Functions (forward's decision, the single linear's backward)."""

from __future__ import annotations

from typing import Any

import torch

from ..core import SplitModule
from ..functional.wgrad import bias_wgrad, linear_wgrad, write_linear_wgrad

__all__ = ["hand_over_linear_wgrad", "linear_wgrad_parameters", "route_wgrad_at_forward"]


def route_wgrad_at_forward(ctx: Any, owner: SplitModule, params: tuple[Any, ...], *, has_bias: bool) -> None:
    """Record on ``ctx`` what the backward routes: ``owner``, ``has_bias``, ``split`` and ``params``.

    Whether the module handles the wgrad itself is fixed at forward (a switch flipped before backward cannot
    make autograd drop it); whether it is parked or run then is decided by the store at backward.

    Args:
        ctx: the Function's context.
        owner: the module whose ``hand_over_wgrad`` the backward calls.
        params: the module's parameters (None where absent) in the order the backward hands gradients over.
        has_bias: the forward got biases.
    """
    ctx.owner = owner
    ctx.has_bias = has_bias
    ctx.split = owner.splits_wgrad()
    ctx.params = params


def linear_wgrad_parameters(owner: SplitModule) -> list[torch.nn.Parameter]:
    """``[weight, bias]`` of a single-linear module, without a bias it does not route.

    With ``return_bias`` the bias gradient flows through autograd (the caller adds the bias).
    """
    return [owner.weight] if owner.bias is None or owner.return_bias else [owner.weight, owner.bias]


def hand_over_linear_wgrad(
    owner: SplitModule, ctx: Any, dy2: torch.Tensor, x2: torch.Tensor, wanted: tuple[bool, bool]
) -> list[torch.Tensor | None]:
    """Route the ``weight``/``bias`` gradients of ``y = x2 @ owner.weight.T + owner.bias``.

    Args:
        owner: the module (its ``weight``, ``bias`` and ``fuse_wgrad_accumulation`` are written to).
        ctx: the Function's context, with ``params``, ``split`` and ``create_graph`` set.
        dy2: ``(tokens, out)`` output gradient; x2: ``(tokens, in)`` the linear's input.
        wanted: ``ctx.needs_input_grad`` of ``(weight, bias)``.

    Returns:
        ``[dweight, dbias]`` to hand back to autograd (None where the module writes them or none is owed).
    """

    def gradients(mask: tuple[bool, ...]) -> list[torch.Tensor | None]:
        return [linear_wgrad(dy2, x2) if mask[0] else None, bias_wgrad(dy2) if mask[1] else None]

    def write(mask: tuple[bool, ...]) -> None:
        write_linear_wgrad(
            owner.weight, owner.bias, dy2, x2, want_w=mask[0], want_b=mask[1],
            fused=owner.fuse_wgrad_accumulation, owner=owner._describe(), name="weight",
        )  # fmt: skip

    return owner.hand_over_wgrad(
        ctx.params, wanted, split=ctx.split, gradients=gradients, write=write, saved=(dy2, x2),
        create_graph=ctx.create_graph,
    )  # fmt: skip
