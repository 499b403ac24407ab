"""Writing a linear op's deferred weight gradient, with the ops' wording for a missing ``main_grad``.

The arithmetic is the modules' (:mod:`splitgrad.module._wgrad`): the immediate path returns
``linear_wgrad(dy, x)`` to autograd and the split path writes exactly that product (or adds it into
``main_grad`` with one addmm), so delayed and immediate modes are bitwise identical.
"""

from __future__ import annotations

import torch
from torch import nn

from ...functional.wgrad import accumulate_grad, linear_wgrad, linear_wgrad_into_main_grad

__all__ = ["weight_grad", "write_weight_grad"]


def weight_grad(dy2: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
    """``dW = dy2.T @ x2`` for ``dy2: (tokens, out)`` and ``x2: (tokens, in)``, shape ``(out, in)``."""
    return linear_wgrad(dy2, x2, with_bias=False)[0]


def write_weight_grad(
    weight: nn.Parameter, dy2: torch.Tensor, x2: torch.Tensor, *, into_main_grad: bool, owner: str, name: str
) -> None:
    """Accumulate ``dy2.T @ x2`` into ``weight.grad`` or (``into_main_grad``) into ``weight.main_grad``.

    Args:
        weight: ``(out, in)``.
        dy2: ``(tokens, out)``; x2: ``(tokens, in)``.
        into_main_grad: the op's ``accumulate_into_main_grad``.
        owner, name: for error messages (the op and the parameter's attribute name).
    """
    if not into_main_grad:
        accumulate_grad(weight, weight_grad(dy2, x2))
        return
    if getattr(weight, "main_grad", None) is None:
        raise RuntimeError(
            f"{owner}: accumulate_into_main_grad=True needs `{name}.main_grad` (a buffer of shape "
            f"{tuple(weight.shape)}, normally set by a data-parallel wrapper), but the parameter has none"
        )
    linear_wgrad_into_main_grad(weight, dy2, x2, owner, name)
