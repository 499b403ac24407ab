"""Small GPT and MoE models built from splitgrad layers, their plain-autograd twins, pipeline stage cutting and
a character-level corpus (for the demo, the pipeline runtime, the tests and the benchmarks)."""

from __future__ import annotations

from .config import GPTConfig, MoEConfig
from .data import CharCorpus, CharTokenizer, TokenDataset, load_char_corpus, stdlib_text
from .gpt import GPT, lm_loss
from .moe import AuxLossInjector, MoEGPT, MoEMLP, moe_aux_loss, moe_layers, set_aux_loss_scale
from .reference import ReferenceModel, reference_twin
from .stages import PipelineStage, split_into_stages, stage_layer_counts
from .tp import shard_gpt_state_dict

__all__ = [
    "GPT",
    "AuxLossInjector",
    "CharCorpus",
    "CharTokenizer",
    "GPTConfig",
    "MoEConfig",
    "MoEGPT",
    "MoEMLP",
    "PipelineStage",
    "ReferenceModel",
    "TokenDataset",
    "lm_loss",
    "load_char_corpus",
    "moe_aux_loss",
    "moe_layers",
    "reference_twin",
    "set_aux_loss_scale",
    "shard_gpt_state_dict",
    "split_into_stages",
    "stage_layer_counts",
    "stdlib_text",
]
