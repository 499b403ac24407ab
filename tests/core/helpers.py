"""Shared test utilities for the core contract: grads snapshots and exact/float64 comparisons."""

from __future__ import annotations

import torch
from torch import nn


def grads(module: nn.Module) -> dict[str, torch.Tensor | None]:
    """Name -> a clone of ``.grad`` (or ``main_grad`` when the parameter has one and no ``.grad``)."""
    out: dict[str, torch.Tensor | None] = {}
    for name, p in module.named_parameters():
        g = p.grad if p.grad is not None else getattr(p, "main_grad", None)
        out[name] = None if g is None else g.detach().clone()
    return out


def assert_same(a: dict, b: dict, *, exact: bool = True, rtol: float = 1e-10, atol: float = 1e-12) -> None:
    """Every entry equal (bitwise when ``exact``) and the same set of Nones."""
    assert a.keys() == b.keys(), (a.keys(), b.keys())
    for k in a:
        if a[k] is None or b[k] is None:
            assert a[k] is None and b[k] is None, f"{k}: one side is None"
            continue
        if exact:
            torch.testing.assert_close(a[k], b[k], rtol=0, atol=0, msg=lambda m, k=k: f"{k}: {m}")
        else:
            torch.testing.assert_close(a[k], b[k], rtol=rtol, atol=atol, msg=lambda m, k=k: f"{k}: {m}")


def attach_main_grad(module: nn.Module, *, fill: float | None = None, seed: int = 0) -> None:
    """Give every parameter an fp32 ``main_grad`` (random when ``fill`` is None, as a DDP buffer mid-step)."""
    gen = torch.Generator().manual_seed(seed)
    for p in module.parameters():
        if fill is None:
            p.main_grad = torch.randn(p.shape, generator=gen, dtype=torch.float32)
        else:
            p.main_grad = torch.full(p.shape, fill, dtype=torch.float32)
