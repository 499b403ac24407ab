"""Writing weight gradients: into ``.grad`` (accumulate) or into a data-parallel ``main_grad`` buffer.

These are the only places splitgrad writes parameter gradients itself, so the accumulate-never-overwrite rule
and Megatron's ``main_grad`` attributes (``overwrite_main_grad``, ``grad_added_to_main_grad``) live here once.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = [
    "accumulate_grad",
    "bias_wgrad",
    "linear_wgrad",
    "linear_wgrad_into_main_grad",
    "require_main_grad",
]


def bias_wgrad(dy: torch.Tensor) -> torch.Tensor:
    """Bias gradient ``(out_features,)`` of ``dy: (tokens, out_features)``."""
    return dy.sum(0)


def linear_wgrad(
    dy: torch.Tensor, x: torch.Tensor, with_bias: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Weight and bias gradient of ``y = x @ W.T + b``.

    Args:
        dy: ``(tokens, out_features)`` output gradient.
        x: ``(tokens, in_features)`` saved input.
        with_bias: also return the bias gradient.

    Returns:
        ``(dW, db)`` with ``dW: (out_features, in_features)`` and ``db: (out_features,)`` or None.
    """
    return dy.t().mm(x), (bias_wgrad(dy) if with_bias else None)


def accumulate_grad(param: nn.Parameter, grad: torch.Tensor) -> None:
    """``param.grad += grad`` (the first write assigns), exactly what autograd's AccumulateGrad computes.

    ``grad`` is cast to the parameter's dtype first (under autocast it is computed in the autocast dtype),
    as autograd casts a returned gradient to its input's dtype.
    """
    if grad.dtype != param.dtype:
        grad = grad.to(param.dtype)
    if param.grad is None:
        param.grad = grad
    else:
        param.grad.add_(grad)


def require_main_grad(param: nn.Parameter, owner: str, name: str) -> torch.Tensor:
    """Return ``param.main_grad`` after checking it exists and matches the parameter's shape."""
    main_grad = getattr(param, "main_grad", None)
    if main_grad is None:
        raise RuntimeError(
            f"{owner}: fuse_wgrad_accumulation=True needs `{name}.main_grad` (an fp32 buffer of shape "
            f"{tuple(param.shape)}, normally set by a data-parallel wrapper such as "
            "splitgrad.parallel.DistributedDataParallel), but the parameter has no `main_grad`"
        )
    if main_grad.shape != param.shape:
        raise RuntimeError(
            f"{owner}: `{name}.main_grad` has shape {tuple(main_grad.shape)}, expected {tuple(param.shape)}"
        )
    return main_grad


def linear_wgrad_into_main_grad(
    param: nn.Parameter, dy: torch.Tensor, x: torch.Tensor, owner: str, name: str = "weight"
) -> None:
    """``param.main_grad += dy.T @ x`` computed straight into the buffer (no weight-sized temporary).

    ``param.overwrite_main_grad = True`` overwrites instead of accumulating; ``param.grad_added_to_main_grad``,
    when the attribute exists, is set True afterwards (Megatron's DDP reads it to skip its own add).

    Args:
        param: the weight, ``(out_features, in_features)``.
        dy: ``(tokens, out_features)``; x: ``(tokens, in_features)``.
    """
    main_grad = require_main_grad(param, owner, name)
    beta = 0.0 if getattr(param, "overwrite_main_grad", False) else 1.0
    if dy.dtype != main_grad.dtype:
        # Mixed precision (bf16 activations, fp32 buffer): upcasting the operands costs activation-sized
        # temporaries, never a weight-sized one, and keeps the whole reduction in the buffer's precision.
        dy = dy.to(main_grad.dtype)
        x = x.to(main_grad.dtype)
    main_grad.addmm_(dy.t(), x, beta=beta)
    if hasattr(param, "grad_added_to_main_grad"):
        param.grad_added_to_main_grad = True
