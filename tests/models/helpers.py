"""Shared helpers of the model tests: tiny float64 configs, seeded models and gradient comparisons
(gradient snapshots: :func:`tests.helpers.grads`)."""

from __future__ import annotations

import torch
from torch import nn

import splitgrad
from splitgrad.models import GPT, GPTConfig, MoEConfig, lm_loss

# float64 twin comparisons: the two sides differ only in rounding (different but equivalent formulas).
RTOL, ATOL = 1e-10, 1e-12


#: The tiny shape every model test shares (float64: the twins differ from the models only in rounding).
_SHAPE = {
    "vocab_size": 37,
    "seq_len": 16,
    "hidden_size": 32,
    "num_layers": 2,
    "num_heads": 4,
    "ffn_hidden_size": 48,
    "params_dtype": torch.float64,
}


def gpt_config(**overrides) -> GPTConfig:
    return GPTConfig(**{**_SHAPE, **overrides})


def moe_config(**overrides) -> MoEConfig:
    experts = {"moe_ffn_hidden_size": 24, "num_experts": 4, "top_k": 2, "aux_loss_coef": 0.1}
    return MoEConfig(**{**_SHAPE, **experts, **overrides})


def build(cls: type[GPT], config: GPTConfig, seed: int = 0) -> GPT:
    """A seeded model whose parameters are all jittered (so norm scales/biases are not the trivial 1/0)."""
    torch.manual_seed(seed)
    model = cls(config)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def batch(config: GPTConfig, batch_size: int = 2, seq: int | None = None, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    shape = (batch_size, seq or config.seq_len)
    return (
        torch.randint(0, config.vocab_size, shape, generator=gen),
        torch.randint(0, config.vocab_size, shape, generator=gen),
    )


def assert_grads(a: dict, b: dict, *, exact: bool = False) -> None:
    """Same names, same Nones, values equal (bitwise when ``exact``, else float64-tight)."""
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    for name in a:
        if a[name] is None or b[name] is None:
            assert a[name] is None and b[name] is None, f"{name}: gradient missing on one side"
            continue
        tol = {"rtol": 0, "atol": 0} if exact else {"rtol": RTOL, "atol": ATOL}
        torch.testing.assert_close(a[name], b[name], **tol, msg=lambda m, n=name: f"{n}: {m}")


def train_step(model: nn.Module, ids: torch.Tensor, targets: torch.Tensor, *, delayed: bool) -> torch.Tensor:
    """Forward, ``lm_loss`` backward, and (delayed) drain the parked weight gradients; returns the loss."""
    loss = lm_loss(model(ids), targets)
    loss.backward()
    if delayed:
        assert splitgrad.pending_wgrad(model) > 0, "delayed model parked no wgrad work"
        splitgrad.backward_dw(model)
    assert splitgrad.pending_wgrad(model) == 0
    return loss.detach()
