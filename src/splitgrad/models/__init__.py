"""Small GPT and MoE models built from splitgrad layers, their plain-autograd twins, pipeline stage cutting and
a character-level corpus (for the demo, the pipeline runtime, the tests and the benchmarks)."""

from __future__ import annotations

from .config import GPTConfig, MoEConfig
from .data import CharCorpus, CharTokenizer, TokenDataset, load_char_corpus, stdlib_text
from .gpt import GPT, lm_loss
from .moe import AuxLossInjector, MoEGPT, MoEMLP, is_moe_layer, moe_aux_loss, moe_layers, set_aux_loss_scale
from .reference import ReferenceModel, reference_twin
from .router import TopKRouter
from .stages import StageModule, split_into_stages, stage_layer_counts
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
    "ReferenceModel",
    "StageModule",
    "TokenDataset",
    "TopKRouter",
    "is_moe_layer",
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


def __getattr__(name: str) -> object:
    # Renamed (it collided with torch.distributed.pipelining.PipelineStage, which the adapter subclasses);
    # the old name keeps working for a while, with a warning.
    if name == "PipelineStage":
        import warnings

        warnings.warn(
            "splitgrad.models.PipelineStage is now splitgrad.models.StageModule",
            DeprecationWarning,
            stacklevel=2,
        )
        return StageModule
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
