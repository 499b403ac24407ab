"""Tiny random transformers v5 MoE models, built from configs in the test (no download), shared per session.

One entry per family: the config keyword arguments that make a 2-layer model of hidden size 64 with 8 experts
(intermediate sizes multiples of 16 bytes in float32, so transformers' own ``grouped_mm`` path runs). Builds are
cached by ``(family, dtype, experts_implementation)`` and handed out as deep copies: every test gets its own
parameters and gradients, and the suite pays for each build once.
"""

from __future__ import annotations

import copy
import functools

import torch

COMMON = {
    "vocab_size": 128, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "max_position_embeddings": 128, "pad_token_id": 0, "bos_token_id": 1,
    "eos_token_id": 2,
}  # fmt: skip
MLA = {"kv_lora_rank": 16, "q_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16}
# Families transformers' experts integration dispatches (decorated experts classes).
DECORATED = {
    "mixtral": {"intermediate_size": 32, "num_local_experts": 8, "num_experts_per_tok": 2},
    "qwen3_moe": {"intermediate_size": 64, "moe_intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 2,
                  "head_dim": 16, "norm_topk_prob": True},
    "deepseek_v3": {"intermediate_size": 64, "moe_intermediate_size": 32, "n_routed_experts": 8,
                    "num_experts_per_tok": 2, "n_shared_experts": 1, "n_group": 2, "topk_group": 1,
                    "first_k_dense_replace": 0, "num_key_value_heads": 4, **MLA},
    "gpt_oss": {"intermediate_size": 32, "num_local_experts": 8, "num_experts_per_tok": 2, "head_dim": 16,
                "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 8},
    "qwen2_moe": {"intermediate_size": 64, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 64,
                  "num_experts": 8, "num_experts_per_tok": 2},
    "olmoe": {"intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 2},
    "granitemoe": {"intermediate_size": 32, "num_local_experts": 8, "num_experts_per_tok": 2},
    "granitemoeshared": {"intermediate_size": 32, "num_local_experts": 8, "num_experts_per_tok": 2,
                         "shared_intermediate_size": 64},
    "granitemoehybrid": {"intermediate_size": 32, "num_local_experts": 8, "num_experts_per_tok": 2,
                         "shared_intermediate_size": 64, "layer_types": ["mamba", "attention"], "mamba_n_heads": 8,
                         "mamba_d_head": 16, "mamba_n_groups": 1, "mamba_d_state": 16, "mamba_chunk_size": 16},
    "jamba": {"intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 2, "attn_layer_period": 2,
              "attn_layer_offset": 1, "expert_layer_period": 1, "expert_layer_offset": 0, "mamba_d_state": 8,
              "mamba_expand": 2, "mamba_dt_rank": 8, "use_mamba_kernels": False},
    "ernie4_5_moe": {"intermediate_size": 64, "moe_intermediate_size": 32, "moe_num_experts": 8, "moe_k": 2,
                     "moe_layer_start_index": 0, "moe_num_shared_experts": 1},
    "glm4_moe": {"intermediate_size": 64, "moe_intermediate_size": 32, "n_routed_experts": 8,
                 "num_experts_per_tok": 2, "first_k_dense_replace": 0, "head_dim": 16},
    "minimax": {"intermediate_size": 32, "num_local_experts": 8, "num_experts_per_tok": 2, "head_dim": 16,
                "layer_types": ["full_attention", "linear_attention"], "block_size": 8},
    "phimoe": {"intermediate_size": 32, "num_local_experts": 8, "num_experts_per_tok": 2,
               "router_jitter_noise": 0.0, "input_jitter_noise": 0.0},
    "deepseek_v2": {"intermediate_size": 64, "moe_intermediate_size": 32, "n_routed_experts": 8,
                    "num_experts_per_tok": 2, "n_shared_experts": 1, "first_k_dense_replace": 0,
                    "num_key_value_heads": 4, **MLA},
    "hunyuan_v1_moe": {"intermediate_size": 32, "num_experts": 8, "moe_topk": 2, "head_dim": 16},
    "flex_olmo": {"intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 2},
    "lfm2_moe": {"intermediate_size": 64, "moe_intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 2,
                 "num_dense_layers": 0, "layer_types": ["conv", "full_attention"]},
    "qwen3_next": {"intermediate_size": 64, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
                   "num_experts": 8, "num_experts_per_tok": 2, "head_dim": 16,
                   "layer_types": ["linear_attention", "full_attention"], "linear_num_value_heads": 4,
                   "linear_num_key_heads": 2, "linear_key_head_dim": 16, "linear_value_head_dim": 16},
    "dots1": {"intermediate_size": 64, "moe_intermediate_size": 32, "n_routed_experts": 8, "num_experts_per_tok": 2,
              "n_shared_experts": 1, "first_k_dense_replace": 0, "head_dim": 16},
    "minimax_m2": {"intermediate_size": 32, "num_local_experts": 8, "num_experts_per_tok": 2, "head_dim": 16},
    "exaone_moe": {"intermediate_size": 64, "moe_intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 2,
                   "head_dim": 16, "first_k_dense_replace": 0},
    "solar_open": {"intermediate_size": 64, "moe_intermediate_size": 32, "n_routed_experts": 8,
                   "num_experts_per_tok": 2, "n_shared_experts": 1, "first_k_dense_replace": 0, "head_dim": 16},
    "aria_text": {"intermediate_size": 64, "moe_num_experts": 8, "moe_topk": 2, "head_dim": 16},
    # An MoE and an attention layer: its Mamba2 layers cost minutes in float64 and are not what is tested here
    # (granitemoehybrid keeps one, for the directly-read out_proj).
    "nemotron_h": {"intermediate_size": 64, "moe_intermediate_size": 32, "head_dim": 16, "n_routed_experts": 8,
                   "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1, "n_shared_experts": 1,
                   "sliding_window": 8, "moe_latent_size": None, "num_nextn_predict_layers": 0,
                   "hybrid_override_pattern": "E*"},
}  # fmt: skip
# Families whose experts transformers' integration does not dispatch.
UNDECORATED = {
    "llama4_text": {"intermediate_size": 32, "intermediate_size_mlp": 64, "num_local_experts": 8,
                    "num_experts_per_tok": 1, "head_dim": 16, "moe_layers": [0, 1],
                    "layer_types": ["chunked_attention", "full_attention"], "no_rope_layers": [1, 0],
                    "attention_chunk_size": 8},
    "dbrx": {"d_model": 64, "n_heads": 4, "n_layers": 2, "max_seq_len": 128,
             "attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
             "ffn_config": {"ffn_hidden_size": 32, "moe_num_experts": 8, "moe_top_k": 2}},
    "jetmoe": {"num_local_experts": 8, "num_experts_per_tok": 2, "kv_channels": 16, "intermediate_size": 32},
    "longcat_flash": {"expert_ffn_hidden_size": 32, "ffn_hidden_size": 64, "n_routed_experts": 8,
                      "zero_expert_num": 2, "moe_topk": 2, "num_key_value_heads": 4, "head_dim": 8, **MLA},
}  # fmt: skip
# transformers' eager NemotronH experts accumulate in the float32 router weights' dtype, so a float64 model's
# eager output is float32-rounded; its batched_mm path multiplies in float64 as the grouped path does.
FLOAT64_REFERENCE = {"nemotron_h": "batched_mm"}
_NOT_COMMON = {"dbrx": ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                        "max_position_embeddings"),
               "nemotron_h": ("num_hidden_layers",)}  # fmt: skip


def config(family: str):
    """The tiny config of ``family`` (a transformers ``model_type``)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    kwargs = {k: v for k, v in COMMON.items() if k not in _NOT_COMMON.get(family, ())}
    kwargs.update(DECORATED.get(family) or UNDECORATED[family])
    return CONFIG_MAPPING[family](**kwargs)


@functools.cache
def _built(family: str, dtype: torch.dtype, implementation: str | None):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    kwargs = {} if implementation is None else {"experts_implementation": implementation}
    return AutoModelForCausalLM.from_config(config(family), dtype=dtype, **kwargs).train()


def model(family: str, dtype: torch.dtype = torch.float64, implementation: str | None = None):
    """A fresh copy of the family's tiny model (seeded: every copy has the same parameters).

    ``implementation``: transformers' experts implementation of the *unconverted* model (default for float64:
    ``"eager"`` or :data:`FLOAT64_REFERENCE`, as transformers' default ``grouped_mm`` refuses float64 on the CPU).
    """
    if implementation is None and dtype == torch.float64 and family in DECORATED:
        implementation = FLOAT64_REFERENCE.get(family, "eager")
    return copy.deepcopy(_built(family, dtype, implementation))


def batch(seed: int = 0) -> torch.Tensor:
    """Token ids ``(2, 16)`` for ``model(input_ids=ids, labels=ids)``."""
    return torch.randint(3, 128, (2, 16), generator=torch.Generator().manual_seed(seed))
