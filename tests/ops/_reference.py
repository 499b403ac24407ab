"""Float64 plain-PyTorch references for the ops tests, and a runner that collects output + every gradient."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

Result = tuple[torch.Tensor, torch.Tensor | None, dict[str, torch.Tensor | None]]


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def silu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(x)


def layer_norm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, eps: float) -> torch.Tensor:
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + eps) * w + b


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def run_module(
    module: Callable, x: torch.Tensor, dy: torch.Tensor, *extra, params: nn.Module | None = None
) -> Result:
    """Forward ``module(x, *extra)``, backward ``dy``; returns ``(y, dx, {name: grad})``."""
    x = x.detach().clone().requires_grad_()
    y = module(x, *extra)
    y.backward(dy)
    owner = params if params is not None else module
    grads = {n: (None if p.grad is None else p.grad.clone()) for n, p in owner.named_parameters()}
    return y.detach(), x.grad, grads


def run_reference(fn: Callable, named: dict[str, torch.Tensor], x: torch.Tensor, dy: torch.Tensor) -> Result:
    """Plain autograd on float64 copies: ``fn(x, params) -> y``."""
    params = {n: p.detach().double().clone().requires_grad_() for n, p in named.items()}
    x = x.detach().double().clone().requires_grad_()
    y = fn(x, params)
    y.backward(dy.double())
    return y.detach(), x.grad, {n: p.grad for n, p in params.items()}


def assert_results_close(got: Result, want: Result, *, rtol: float = 1e-10, atol: float = 1e-12) -> None:
    """Output, input gradient and every parameter gradient agree (same set of Nones)."""
    (y, dx, g), (ry, rdx, rg) = got, want
    torch.testing.assert_close(y.double(), ry, rtol=rtol, atol=atol, msg=lambda m: f"output: {m}")
    assert (dx is None) == (rdx is None), "input gradient: one side is None"
    if dx is not None:
        torch.testing.assert_close(dx.double(), rdx, rtol=rtol, atol=atol, msg=lambda m: f"dx: {m}")
    assert g.keys() == rg.keys(), (g.keys(), rg.keys())
    for k in g:
        assert (g[k] is None) == (rg[k] is None), f"{k}: one side is None"
        if g[k] is not None:
            torch.testing.assert_close(
                g[k].double(), rg[k], rtol=rtol, atol=atol, msg=lambda m, k=k: f"{k}: {m}"
            )


def assert_results_equal(got: Result, want: Result) -> None:
    """Bitwise equality (``rtol=0, atol=0``) of output and every gradient."""
    assert_results_close(got, want, rtol=0, atol=0)


def linear_ref(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    y = x @ w.t()
    return y if b is None else y + b


def grouped_ref(x: torch.Tensor, p: dict, sizes: list[int], n: int, bias: bool) -> torch.Tensor:
    outs = [
        linear_ref(xg, p[f"weight{g}"], p[f"bias{g}"] if bias else None)
        for g, xg in enumerate(x.reshape(-1, x.shape[-1]).split(sizes))
    ]
    return torch.cat(outs).view(*x.shape[:-1], -1)
