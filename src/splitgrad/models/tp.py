"""Cut a ``tp_size=1`` GPT's state dict (or gradients) into one tensor-parallel rank's shards.

With it a TP model starts from exactly the weights of the unsplit one, which is how the tests compare the two
(and how a checkpoint of the unsplit model is loaded into a TP run).
"""

from __future__ import annotations

import torch

from .config import GPTConfig

__all__ = ["shard_gpt_state_dict"]


def _rows(t: torch.Tensor, parts: int, rank: int, tp_size: int) -> torch.Tensor:
    """Rows of ``t`` seen as ``parts`` stacked blocks (q/k/v, gate/value): this rank's rows of each block."""
    blocks = t.chunk(parts, dim=0)
    return torch.cat([b.chunk(tp_size, dim=0)[rank] for b in blocks])


def shard_gpt_state_dict(
    state: dict[str, torch.Tensor], config: GPTConfig, tp_rank: int, tp_size: int
) -> dict[str, torch.Tensor]:
    """This rank's part of a full (``tp_size=1``) GPT state dict, for ``GPT(config, tp_group=...)``.

    ``attn.qkv`` rows: this rank's heads of q, k and v; ``attn.proj`` columns; ``mlp.fc1_*`` rows (of both
    halves of a gated activation); ``mlp.fc2_weight`` columns; everything else (embeddings, norms, row biases,
    the head) whole. Works on any dict keyed like ``GPT.named_parameters()`` (gradients too).

    Args:
        state: the full model's tensors by name.
        config: the TP model's config (``activation`` decides whether fc1 is gated).
        tp_rank, tp_size: this rank and the group size.

    Returns:
        A new dict with the same keys, sharded tensors cloned.
    """
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"shard_gpt_state_dict: need 0 <= tp_rank < tp_size, got {tp_rank=} {tp_size=}")
    gated = 2 if config.activation in ("swiglu", "geglu") else 1
    out = {}
    for name, t in state.items():
        leaf = name.rsplit(".", 1)[-1]
        if ".attn.qkv." in name and leaf in ("weight", "bias"):
            t = _rows(t, 3, tp_rank, tp_size)
        elif ".attn.proj." in name and leaf == "weight":
            t = t.chunk(tp_size, dim=1)[tp_rank]
        elif ".mlp." in name and leaf in ("fc1_weight", "fc1_bias"):
            t = _rows(t, gated, tp_rank, tp_size)
        elif ".mlp." in name and leaf == "fc2_weight":
            t = t.chunk(tp_size, dim=1)[tp_rank]
        out[name] = t.clone()
    return out
