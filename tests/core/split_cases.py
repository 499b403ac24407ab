"""Every split-capable layer family, built twice from one seed: deferred (or fused) and immediate.

Why: the routing of weight gradients is written once (``SplitModule.hand_over_wgrad``) and must hold for
every class that uses it, modules and ops alike; these cases let one test body cover all of them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import nn

import splitgrad
from splitgrad import ops

F64 = torch.float64


@dataclasses.dataclass(frozen=True)
class Case:
    """A layer family: ``make(delay)`` builds it (float64), ``run(layer, x)`` calls it on ``x: (6, 4)``."""

    name: str
    make: Callable[[bool], nn.Module]
    run: Callable[[nn.Module, torch.Tensor], torch.Tensor] = lambda layer, x: layer(x)


def _seq(delay: bool) -> nn.Module:
    return ops.Sequential(
        ops.LayerNorm(4, dtype=F64),
        ops.Linear(4, 8, delay_wgrad_compute=delay, dtype=F64),
        ops.GELU(),
        ops.Linear(8, 4, delay_wgrad_compute=delay, dtype=F64),
    )


CASES = [
    Case("Linear", lambda d: splitgrad.Linear(4, 5, delay_wgrad_compute=d, params_dtype=F64)),
    Case(
        "LayerNormLinear", lambda d: splitgrad.LayerNormLinear(4, 5, delay_wgrad_compute=d, params_dtype=F64)
    ),
    Case("LayerNormMLP", lambda d: splitgrad.LayerNormMLP(4, 8, delay_wgrad_compute=d, params_dtype=F64)),
    Case(
        "GroupedLinear",
        lambda d: splitgrad.GroupedLinear(2, 4, 5, delay_wgrad_compute=d, params_dtype=F64),
        lambda layer, x: layer(x, [2, 4]),
    ),
    Case("ops.BasicLinear", lambda d: ops.BasicLinear(4, 5, delay_wgrad_compute=d, dtype=F64)),
    Case("ops.Linear", lambda d: ops.Linear(4, 5, delay_wgrad_compute=d, dtype=F64)),
    Case(
        "ops.GroupedLinear",
        lambda d: ops.GroupedLinear(2, 4, 5, delay_wgrad_compute=d, dtype=F64),
        lambda layer, x: layer(x, [2, 4]),
    ),
    Case("ops.Sequential", _seq),
]


def twins(case: Case) -> tuple[nn.Module, nn.Module]:
    """``(deferred, immediate)`` with identical parameters."""
    torch.manual_seed(0)
    delayed = case.make(True)
    torch.manual_seed(0)
    immediate = case.make(False)
    return delayed, immediate


def loss_of(case: Case, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A loss with a fixed random output weighting (no symmetric gradients)."""
    y = case.run(layer, x)
    w = torch.randn(y.shape, generator=torch.Generator().manual_seed(1), dtype=y.dtype)
    return (y * w).sum()


def inputs() -> tuple[torch.Tensor, torch.Tensor]:
    """Two identical leaf inputs ``(6, 4)`` (one per twin)."""
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(2), dtype=F64)
    return x.clone().requires_grad_(), x.clone().requires_grad_()


def param_grads(layer: nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: (None if p.grad is None else p.grad.clone()) for n, p in layer.named_parameters()}
