"""A HuggingFace transformers v5 decoder (``*ForCausalLM``) cut into pipeline stages for splitgrad's runtime.

The runtime moves one tensor between stages, but a transformers decoder layer also needs the rotary
``position_embeddings`` and the attention mask, which the HF model computes once in its ``forward`` and hands to
every layer. Sending them along would mean several boundary tensors (and a mask without a gradient); each
:class:`HFDecoderStage` rebuilds them instead, from the hidden states it receives, exactly as the HF model's
``forward`` does: ``position_ids = arange(seq)``, its own copy of the model's rotary embedding (buffers only),
``create_causal_mask`` / ``create_sliding_window_causal_mask`` of ``transformers.masking_utils``. The first stage
owns the token embedding, the last the final norm and the LM head; the decoder layers are shared with the model
(not copied), so ``splitgrad.convert`` may run before or after the cut.

Scope: no padding mask, no KV cache (training on full sequences); the mask kinds follow the HF forward of the
pinned transformers (``config.layer_types`` where the model has sliding layers, else ``config.sliding_window``
for every layer). Checked on Llama, Qwen3, Qwen3-MoE and Mixtral (tests/integrations/test_hf_pipeline.py).
An MoE model's router aux loss is not part of the stages' output (the runtime's loss is ``loss_fn(logits,
targets)``), as with ``output_router_logits=False``.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

__all__ = ["HFDecoderStage", "hf_pipeline_stages"]

logger = logging.getLogger(__name__)

_PARTS = ("model.embed_tokens", "model.layers", "model.norm", "model.rotary_emb", "lm_head")


class HFDecoderStage(nn.Module):
    """One pipeline stage of a transformers decoder: ``(batch, seq)`` ids (first stage) or hidden states
    ``(batch, seq, hidden)`` -> hidden states, or logits ``(batch, seq, vocab)`` on the last stage.

    Args:
        config: the HF model's config (read by the mask builders).
        layers: this stage's decoder layers, in order (shared with the model).
        mask_kinds: per layer, ``"full_attention"`` or ``"sliding_attention"``.
        rotary: this stage's rotary embedding (a copy of the model's).
        embed: the token embedding (first stage only).
        norm: the final norm (last stage only, with ``lm_head``).
        lm_head: the output projection (last stage only).
    """

    def __init__(
        self,
        config: Any,
        layers: Sequence[nn.Module],
        mask_kinds: Sequence[str],
        rotary: nn.Module,
        *,
        embed: nn.Module | None = None,
        norm: nn.Module | None = None,
        lm_head: nn.Module | None = None,
    ) -> None:
        super().__init__()
        if len(layers) != len(mask_kinds):
            raise ValueError(f"HFDecoderStage: {len(layers)} layers but {len(mask_kinds)} mask kinds")
        if (norm is None) != (lm_head is None):
            raise ValueError("HFDecoderStage: the last stage needs both norm and lm_head")
        self.config = config
        self.embed_tokens = embed
        self.layers = nn.ModuleList(layers)
        self.mask_kinds = list(mask_kinds)
        self.rotary_emb = rotary
        self.norm = norm
        self.lm_head = lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        hidden = self.embed_tokens(x) if self.embed_tokens is not None else x
        if hidden.dim() != 3:
            raise ValueError(
                f"HFDecoderStage: expected {'ids (batch, seq)' if self.embed_tokens is not None else 'hidden states (batch, seq, hidden)'}, "
                f"got shape {tuple(x.shape)}"
            )
        position_ids = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        position_embeddings = self.rotary_emb(hidden, position_ids=position_ids)
        builders = {
            "full_attention": create_causal_mask,
            "sliding_attention": create_sliding_window_causal_mask,
        }
        masks = {
            kind: builders[kind](
                config=self.config,
                inputs_embeds=hidden,
                attention_mask=None,
                cache=None,
                position_ids=position_ids,
            )
            for kind in set(self.mask_kinds)
        }
        for layer, kind in zip(self.layers, self.mask_kinds):
            hidden = layer(
                hidden,
                attention_mask=masks[kind],
                position_embeddings=position_embeddings,
                position_ids=position_ids,
            )
        if self.lm_head is not None:
            hidden = self.lm_head(self.norm(hidden))
        return hidden


def _mask_kinds(model: nn.Module) -> list[str]:
    """Each decoder layer's mask kind, by the rule of the HF model's own ``forward``."""
    config = model.config
    n = config.num_hidden_layers
    if getattr(model.model, "has_sliding_layers", None) is not None:  # Qwen3 / Qwen2 style: per layer type
        kinds = list(config.layer_types[:n])
    else:  # Llama / Mixtral / Qwen3-MoE style: one mask for every layer
        kinds = [
            "sliding_attention" if getattr(config, "sliding_window", None) is not None else "full_attention"
        ] * n
    unknown = sorted(set(kinds) - {"full_attention", "sliding_attention"})
    if unknown:
        raise ValueError(
            f"hf_pipeline_stages: {type(model).__name__} has layer types {unknown}; only full and sliding-window "
            "attention layers are supported"
        )
    return kinds


def hf_pipeline_stages(
    model: nn.Module, n_stages: int, *, layers_per_stage: Sequence[int] | None = None
) -> list[HFDecoderStage]:
    """Cut a transformers v5 ``*ForCausalLM`` into ``n_stages`` contiguous :class:`HFDecoderStage`\\ s.

    Feed the result to :func:`splitgrad.pipeline.build_runtime` (every rank builds the same model and keeps its
    own stages; ``zbv`` wants two stages per rank). The stages share the model's embedding, decoder layers,
    norm and head; each has its own copy of the rotary embedding and builds its own causal mask.

    Args:
        model: e.g. ``Qwen3ForCausalLM``, ``LlamaForCausalLM``, ``MixtralForCausalLM``, ``Qwen3MoeForCausalLM``:
            ``model.model.{embed_tokens, layers, norm, rotary_emb}`` and ``model.lm_head``, untied embeddings.
        n_stages: number of stages (>= 1).
        layers_per_stage: decoder layers per stage (default as even as possible, earlier stages one larger);
            the first and last stage may hold none, middle stages need one.

    Returns:
        The stages in order: stage 0 takes ids ``(batch, seq)`` int64, the last returns logits
        ``(batch, seq, vocab)`` (feed them with the next-token targets to ``splitgrad.models.lm_loss``).

    Raises:
        ValueError: a missing part (named), tied embeddings with more than one stage, bad ``layers_per_stage``,
            an attention kind other than full / sliding window.
    """
    for path in _PARTS:
        owner: Any = model
        for attr in path.split("."):
            owner = getattr(owner, attr, None)
        if owner is None:
            raise ValueError(
                f"hf_pipeline_stages: {type(model).__name__} has no {path}; expected a transformers *ForCausalLM "
                f"decoder with parts {_PARTS}"
            )
    if n_stages < 1:
        raise ValueError(f"hf_pipeline_stages: n_stages must be >= 1, got {n_stages=}")
    if n_stages > 1 and model.lm_head.weight is model.model.embed_tokens.weight:
        raise ValueError(
            f"hf_pipeline_stages: {type(model).__name__} ties lm_head to embed_tokens; a tied weight cannot live "
            f"on the first and the last of {n_stages=} stages. Build it with tie_word_embeddings=False."
        )
    layers = list(model.model.layers[: model.config.num_hidden_layers])
    if layers_per_stage is None:
        base, extra = divmod(len(layers), n_stages)
        counts = [base + (i < extra) for i in range(n_stages)]
    else:
        counts = [int(c) for c in layers_per_stage]
    middle_empty = [i for i, c in enumerate(counts) if c == 0 and 0 < i < n_stages - 1]
    if len(counts) != n_stages or sum(counts) != len(layers) or min(counts) < 0 or middle_empty:
        raise ValueError(
            "hf_pipeline_stages: layers_per_stage must have n_stages non-negative entries summing to the "
            f"{len(layers)} decoder layers, with no empty middle stage; got {counts=} {n_stages=}"
        )
    kinds = _mask_kinds(model)
    stages, start = [], 0
    for i, count in enumerate(counts):
        last = i == n_stages - 1
        stages.append(
            HFDecoderStage(
                model.config,
                layers[start : start + count],
                kinds[start : start + count],
                copy.deepcopy(model.model.rotary_emb),
                embed=model.model.embed_tokens if i == 0 else None,
                norm=model.model.norm if last else None,
                lm_head=model.lm_head if last else None,
            )
        )
        start += count
    return stages
