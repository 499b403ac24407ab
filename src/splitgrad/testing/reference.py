"""Float64 references for distributed tests: shard a batch, run plain autograd, compare named gradients.

A data-parallel (or pipelined) run is correct when every rank's averaged gradient equals the gradient of the
*whole* batch computed in one process with plain autograd. These helpers build that reference and compare
against it with the parameter's name in every failure message.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import nn

from ..core import split_modules

__all__ = ["assert_grads_close", "main_grads", "make_plain", "plain_autograd_grads", "shard"]


def shard(batch: torch.Tensor, rank: int, world_size: int, dim: int = 0) -> torch.Tensor:
    """Rank ``rank``'s equal, contiguous share of ``batch`` along ``dim``.

    Args:
        batch: ``(n, ...)`` with ``n`` divisible by ``world_size``.

    Returns:
        ``(n / world_size, ...)``.
    """
    n = batch.shape[dim]
    if n % world_size:
        raise ValueError(f"shard: batch dimension {dim} of size {n} is not divisible by {world_size=}")
    return batch.chunk(world_size, dim)[rank].contiguous()


def make_plain(model: nn.Module) -> nn.Module:
    """Switch every splitgrad module of ``model`` (in place) to plain autograd: no delay, no fused main_grad."""
    for _, module in split_modules(model):
        # A composite op exposes its inner op's switch as a read-only property; the inner op is visited too.
        if not isinstance(getattr(type(module), "fuse_wgrad_accumulation", None), property):
            module.fuse_wgrad_accumulation = False
        module.set_delay_wgrad_compute(False)
    return model


def plain_autograd_grads(
    model: nn.Module, loss_fn: Callable[[nn.Module], torch.Tensor]
) -> dict[str, torch.Tensor]:
    """``loss_fn(model).backward()`` with plain autograd; returns ``{name: grad clone}`` of trainable params.

    ``model`` should be a separate copy (e.g. rebuilt and loaded from a state_dict): it is made plain with
    :func:`make_plain` and its ``.grad`` fields are overwritten.
    """
    make_plain(model)
    model.zero_grad(set_to_none=True)
    loss_fn(model).backward()
    out = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            if p.grad is None:
                raise RuntimeError(f"plain_autograd_grads: parameter {name!r} got no gradient from loss_fn")
            out[name] = p.grad.detach().clone()
    return out


def main_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """``{name: main_grad clone}`` of every parameter that has one."""
    return {
        name: p.main_grad.detach().clone() for name, p in model.named_parameters() if hasattr(p, "main_grad")
    }


def assert_grads_close(
    actual: Mapping[str, torch.Tensor],
    expected: Mapping[str, torch.Tensor],
    *,
    exact: bool = False,
    rtol: float = 1e-10,
    atol: float = 1e-12,
    what: str = "",
) -> None:
    """Same names, and every tensor equal (bitwise when ``exact``) within tolerance; names the offender."""
    if set(actual) != set(expected):
        raise AssertionError(f"{what}: parameter names differ: {sorted(set(actual) ^ set(expected))}")
    for name in expected:
        a = actual[name].to(expected[name].dtype)
        tol = {"rtol": 0.0, "atol": 0.0} if exact else {"rtol": rtol, "atol": atol}
        torch.testing.assert_close(a, expected[name], **tol, msg=lambda m, n=name: f"{what}: {n}: {m}")
