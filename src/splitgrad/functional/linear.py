"""Pieces shared by the composite modules: ``nn.Linear`` initialisation and writing one linear's wgrad.

:func:`write_linear_wgrad` is the composite modules' version of ``Linear._write_wgrad``: the one function a
deferred task (and the fused-immediate path) calls, using the same arithmetic as the gradients returned to
autograd in plain immediate mode (:func:`~splitgrad.module._wgrad.linear_wgrad`), so every mode is bitwise
identical.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .wgrad import accumulate_grad, bias_wgrad, linear_wgrad, linear_wgrad_into_main_grad

__all__ = ["linear_init_", "write_linear_wgrad"]


def linear_init_(weight: nn.Parameter, bias: nn.Parameter | None) -> None:
    """``torch.nn.Linear``'s initialisation of ``weight: (out, in)`` and ``bias: (out,)``."""
    nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
    if bias is not None:
        fan_in = weight.shape[1]
        bound = 1 / math.sqrt(fan_in) if fan_in > 0 else 0
        nn.init.uniform_(bias, -bound, bound)


def write_linear_wgrad(
    weight: nn.Parameter,
    bias: nn.Parameter | None,
    dy: torch.Tensor,
    x: torch.Tensor,
    *,
    want_w: bool,
    want_b: bool,
    fused: bool,
    owner: str,
    name: str,
) -> None:
    """Accumulate the gradients of ``y = x @ weight.T + bias`` into ``.grad`` / ``weight.main_grad``.

    Args:
        weight: ``(out, in)``; with ``fused`` its gradient is added into ``weight.main_grad``.
        bias: ``(out,)`` or None; its gradient always goes to ``.grad``.
        dy: ``(tokens, out)`` output gradient; x: ``(tokens, in)`` saved input.
        want_w, want_b: which gradients are owed (frozen parameters get none).
        fused: ``fuse_wgrad_accumulation``.
        owner, name: for error messages (``name`` is the weight's attribute name).
    """
    if want_w:
        if fused:
            linear_wgrad_into_main_grad(weight, dy, x, owner, name)
        else:
            accumulate_grad(weight, linear_wgrad(dy, x, with_bias=False)[0])
    if want_b:
        accumulate_grad(bias, bias_wgrad(dy))
