"""torchtitan's llama3 debug model, shrunk to three layers, with packed-document batches (shared test helpers).

The model is torchtitan's own ``llama3_configs["debugmodel"]`` (dim 256, 16 heads, vocab 2048, fused QKV,
FlexAttention) with its layer list cut to ``N_LAYERS``; parameters are float64 (built under float64 as the
default dtype: ``Module.to(float64)`` would turn the complex RoPE cache real). torchtitan itself computes RoPE
and the cross-entropy in float32 (``.float()`` in its code); the reference runs the same code, so the
comparisons stay at float64 rounding.
"""

from __future__ import annotations

import torch
from torch import nn

N_LAYERS = 3
SEQ = 128
N_MICROBATCHES = 4


def debug_model(n_layers: int = N_LAYERS, seed: int = 0) -> nn.Module:
    """torchtitan's llama3 ``debugmodel`` with its first ``n_layers`` layers, float64, initialised."""
    from torchtitan.models.llama3 import llama3_configs

    config = llama3_configs["debugmodel"](attn_backend="flex")
    config.layers = config.layers[:n_layers]
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(seed)
        model = config.build()
        model.init_states()
    finally:
        torch.set_default_dtype(previous)
    return model


def packed_positions(cuts: list[int], seq: int = SEQ) -> list[torch.Tensor]:
    """One ``(1, seq)`` position row per cut: two packed documents, positions restarting at the cut."""
    return [torch.cat([torch.arange(c), torch.arange(seq - c)]).unsqueeze(0) for c in cuts]


def batch(model: nn.Module, seed: int = 1) -> dict[str, list[torch.Tensor]]:
    """``N_MICROBATCHES`` microbatches of one packed row each, and the BlockMask torchtitan builds for each.

    Returns:
        ``{"tokens", "labels", "positions": [(1, SEQ) int64, ...], "masks": [BlockMask, ...]}``.
    """
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(seed)
    tokens = [torch.randint(0, vocab, (1, SEQ), generator=gen) for _ in range(N_MICROBATCHES)]
    labels = [torch.randint(0, vocab, (1, SEQ), generator=gen) for _ in range(N_MICROBATCHES)]
    positions = packed_positions([SEQ * 2 // 5, SEQ // 7, SEQ * 3 // 4, SEQ // 2])
    return {
        "tokens": tokens,
        "labels": labels,
        "positions": positions,
        # What torchtitan's trainer does per microbatch: causal within each packed document.
        "masks": [model.get_attention_masks(p) for p in positions],
    }


def loss_fn(pred: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """torchtitan's cross-entropy (sum over tokens) over the step's token count, as ``(loss, metrics)``."""
    from torchtitan.components.loss import cross_entropy_loss

    return cross_entropy_loss(pred, labels) / (N_MICROBATCHES * SEQ), {}


def reference(model: nn.Module, data: dict) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """Per-microbatch losses and accumulated gradients of the whole model in one process (a deep copy).

    Args:
        model: the whole model (not changed).
        data: :func:`batch`'s output.
    """
    import copy

    twin = copy.deepcopy(model)
    losses = []
    for tok, lab, pos, mask in zip(data["tokens"], data["labels"], data["positions"], data["masks"]):
        loss, _ = loss_fn(twin(tok, positions=pos, attention_masks=mask), lab)
        loss.backward()
        losses.append(loss.detach())
    return losses, {name: p.grad for name, p in twin.named_parameters()}


@torch.no_grad()
def losses_with(model: nn.Module, data: dict, masks: list) -> list[torch.Tensor]:
    """Per-microbatch losses of the whole model with ``masks`` instead of ``data["masks"]`` (forward only)."""
    return [
        loss_fn(model(tok, positions=pos, attention_masks=mask), lab)[0]
        for tok, lab, pos, mask in zip(data["tokens"], data["labels"], data["positions"], masks)
    ]
