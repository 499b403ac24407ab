"""Config validation: a bad architecture is refused at construction with the offending values.

Why: a silently accepted ``hidden_size % num_heads != 0`` or unknown activation would surface much later as
an opaque shape error inside a pipeline stage on some other rank.
"""

from __future__ import annotations

import pytest

from splitgrad.models import GPTConfig, MoEConfig


def test_defaults_are_filled_in():
    config = GPTConfig(vocab_size=10, seq_len=8, hidden_size=16, num_heads=2)
    assert config.ffn_hidden_size == 64 and config.head_dim == 8 and not config.tie_embeddings
    moe = MoEConfig(vocab_size=10, seq_len=8, hidden_size=16, num_heads=2, ffn_hidden_size=24)
    assert moe.moe_ffn_hidden_size == 24


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"hidden_size": 30, "num_heads": 4}, "hidden_size=30 num_heads=4"),
        ({"vocab_size": 0}, "vocab_size"),
        ({"activation": "tanh"}, "activation='tanh'"),
        ({"normalization": "BatchNorm"}, "normalization='BatchNorm'"),
        ({"dropout": 1.0}, "dropout=1.0"),
    ],
)
def test_bad_gpt_configs_are_rejected(overrides, message):
    with pytest.raises(ValueError, match=message):
        GPTConfig(**{"vocab_size": 10, "seq_len": 8, "hidden_size": 16, "num_heads": 2, **overrides})


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"top_k": 0}, "top_k=0"),
        ({"num_experts": 0, "top_k": 0}, "num_experts=0"),
        ({"aux_loss_coef": -1.0}, "aux_loss_coef=-1.0"),
    ],
)
def test_bad_moe_configs_are_rejected(overrides, message):
    with pytest.raises(ValueError, match=message):
        MoEConfig(**{"vocab_size": 10, "seq_len": 8, "hidden_size": 16, "num_heads": 2, **overrides})


def test_configs_are_keyword_only():
    with pytest.raises(TypeError):
        GPTConfig(10, 8)  # type: ignore[misc]
