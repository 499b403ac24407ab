"""Shared pieces of the graph tests: twin models, one eager/graphed training step, exact comparisons."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

import splitgrad


def seeded(build: Callable[[], nn.Module], seed: int = 0) -> nn.Module:
    """``build()`` under a fixed seed, so two calls give identical parameters."""
    torch.manual_seed(seed)
    return build()


def mlp(*, delay: bool = True, fuse: bool = False, dtype: torch.dtype = torch.float32) -> nn.Sequential:
    """splitgrad Linear -> GELU -> splitgrad Linear -> plain nn.Linear (a non-split layer in the mix)."""
    kw = {"delay_wgrad_compute": delay, "fuse_wgrad_accumulation": fuse, "params_dtype": dtype}
    return nn.Sequential(
        splitgrad.Linear(6, 10, **kw),
        nn.GELU(),
        splitgrad.Linear(10, 5, **kw),
        nn.Linear(5, 4, dtype=dtype),
    )


def give_main_grad(model: nn.Module, *, with_flag: bool = True) -> None:
    """A data-parallel wrapper's fp32 ``main_grad`` buffers (Megatron attributes included) on every matrix a
    splitgrad layer or op fuses its weight gradient into."""
    for _, module in splitgrad.split_modules(model):
        fused = getattr(module, "fuse_wgrad_accumulation", False) or getattr(
            module, "accumulate_into_main_grad", False
        )
        for p in module.get_backward_dw_params() if fused else ():
            if p.dim() >= 2 and not hasattr(p, "main_grad"):
                p.main_grad = torch.zeros(p.shape, dtype=torch.float32)
                if with_flag:
                    p.grad_added_to_main_grad = False


def count_hooks(model: nn.Module) -> dict[str, int]:
    """Register a counting wgrad hook on every split-capable submodule; returns the live counters."""
    counts: dict[str, int] = {}
    for name, module in splitgrad.split_modules(model):
        counts[name] = 0

        def hook(name: str = name) -> None:
            counts[name] += 1

        module.register_wgrad_accumulation_and_reduce_hooks(hook)
    return counts


def loss_of(y: torch.Tensor) -> torch.Tensor:
    return (y * torch.linspace(-1, 1, y.shape[-1], dtype=y.dtype)).square().sum()


def eager_step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    y = model(x)
    loss_of(y).backward()
    splitgrad.backward_dw(model)
    return y.detach()


def graphed_step(graphed, x: torch.Tensor) -> torch.Tensor:
    y = graphed(x)
    loss_of(y).backward()
    if graphed.need_backward_dw():
        graphed.backward_dw()
    return y.detach().clone()


def grad_state(model: nn.Module) -> dict[str, object]:
    """Every gradient-like attribute of every parameter, by name (values cloned)."""
    state: dict[str, object] = {}
    for name, p in model.named_parameters():
        state[f"{name}.grad"] = None if p.grad is None else p.grad.clone()
        if hasattr(p, "main_grad"):
            state[f"{name}.main_grad"] = p.main_grad.clone()
        if hasattr(p, "grad_added_to_main_grad"):
            state[f"{name}.grad_added_to_main_grad"] = p.grad_added_to_main_grad
    return state


def assert_same_state(a: dict[str, object], b: dict[str, object]) -> None:
    """Bitwise equality of two :func:`grad_state` results (None must match None)."""
    assert a.keys() == b.keys(), (a.keys(), b.keys())
    for key in a:
        va, vb = a[key], b[key]
        if isinstance(va, torch.Tensor) or isinstance(vb, torch.Tensor):
            assert isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor), f"{key}: {va!r} vs {vb!r}"
            torch.testing.assert_close(va, vb, rtol=0, atol=0, msg=lambda m, key=key: f"{key}: {m}")
        else:
            assert va == vb, f"{key}: {va!r} vs {vb!r}"


def changed_params(before: dict[str, object], after: dict[str, object]) -> set[str]:
    """Names of the parameters whose :func:`grad_state` entries differ between two snapshots."""
    changed = set()
    for key, value in after.items():
        old = before.get(key)
        if isinstance(value, torch.Tensor) and isinstance(old, torch.Tensor):
            same = torch.equal(value, old)
        else:
            same = value is old or value == old
        if not same:
            changed.add(key.rsplit(".", 1)[0])
    return changed
