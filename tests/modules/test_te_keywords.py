"""Every Transformer Engine constructor keyword of Linear / LayerNormLinear / LayerNormMLP, row by row.

Why: ported TE/Megatron code passes TE's keywords; each must either work with TE's meaning, change nothing
(documented), or stop construction with a ValueError that names it — never a TypeError, never a silently
ignored request. The table in docs/modules.md is parsed here and every row checked against the code, so the
docs, ``splitgrad.module._te_keywords`` and the constructors cannot drift apart.
"""

from __future__ import annotations

import inspect
import pathlib
import re

import pytest
import torch

import splitgrad
from splitgrad.module._te_keywords import DEFAULT_ONLY, NO_EFFECT, SUPPORTED, TE_KEYWORDS

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "modules.md"
CLASSES = {"Linear": splitgrad.Linear, "LayerNormLinear": splitgrad.LayerNormLinear,
           "LayerNormMLP": splitgrad.LayerNormMLP}  # fmt: skip
SIZES = {"Linear": (8, 6), "LayerNormLinear": (8, 6), "LayerNormMLP": (8, 16)}

# TE's constructor keywords (transformer_engine/pytorch/module/*.py at d0067d0), transcribed by hand.
TE_SIGNATURES = {
    "Linear": """in_features out_features sequence_parallel fuse_wgrad_accumulation tp_group tp_size
        get_rng_state_tracker rng_tracker_name init_method bias return_bias params_dtype parallel_mode
        parameters_split device ub_overlap_ag ub_overlap_rs ub_overlap_rs_dgrad ub_bulk_dgrad ub_bulk_wgrad
        ub_name delay_wgrad_compute symmetric_ar_type save_original_input name""",
    "LayerNormLinear": """in_features out_features eps sequence_parallel fuse_wgrad_accumulation tp_group
        tp_size get_rng_state_tracker init_method bias normalization return_bias params_dtype parallel_mode
        return_layernorm_output return_layernorm_output_gathered parameters_split zero_centered_gamma device
        ub_overlap_ag ub_overlap_rs ub_overlap_rs_dgrad ub_bulk_wgrad ub_bulk_dgrad ub_name
        delay_wgrad_compute symmetric_ar_type name""",
    "LayerNormMLP": """hidden_size ffn_hidden_size eps sequence_parallel return_bias get_rng_state_tracker
        tp_group tp_size init_method bias normalization activation activation_params output_layer_init_method
        fuse_wgrad_accumulation params_dtype return_layernorm_output return_layernorm_output_gathered
        seq_length micro_batch_size set_parallel_mode zero_centered_gamma device ub_overlap_ag name
        ub_overlap_rs ub_overlap_rs_dgrad ub_bulk_dgrad ub_bulk_wgrad delay_wgrad_compute symmetric_ar_type
        checkpoint""",
}

# A value other than TE's default for every default-only / no-effect keyword (what a port could pass).
NON_DEFAULT = {
    "activation_params": {"limit": 7.0},
    "return_layernorm_output": True,
    "return_layernorm_output_gathered": True,
    "parameters_split": ("query_", "key_", "value_"),
    "symmetric_ar_type": "two_shot",
    "save_original_input": True,
    "checkpoint": True,
    "seq_length": 128,
    "micro_batch_size": 2,
    "ub_name": "qkv",
    **{
        ub: True
        for ub in ("ub_overlap_ag", "ub_overlap_rs", "ub_overlap_rs_dgrad", "ub_bulk_dgrad", "ub_bulk_wgrad")
    },
}


def doc_rows() -> list[tuple[str, str, str]]:
    """``(keyword, layer, status)`` for every row of the docs table (a row lists one or more layers)."""
    text = DOC.read_text()
    rows = []
    for line in text.splitlines():
        m = re.match(r"\| `(\w+)` \| ([\w, ]+) \| (supported|no effect|default only) \|", line)
        if m:
            rows += [(m[1], layer.strip(), m[3]) for layer in m[2].split(",")]
    return rows


ROWS = doc_rows()


def check_row(keyword: str, layer: str, status: str) -> None:
    """Fail (AssertionError) unless ``layer``'s constructor handles ``keyword`` as ``status`` says."""
    cls, sizes = CLASSES[layer], SIZES[layer]
    params = inspect.signature(cls).parameters
    assert keyword in params, f"{layer} has no keyword {keyword}"
    if status == SUPPORTED:
        return  # behaviour: the tests named in docs/modules.md and docs/tensor_parallel.md
    value = NON_DEFAULT[keyword]
    default = params[keyword].default
    assert default is None or default is False, f"{layer}.{keyword}: default {default!r} is not TE's"
    if status == DEFAULT_ONLY:
        cls(*sizes, **{keyword: default})
        with pytest.raises(ValueError, match=rf"{keyword}={re.escape(repr(value))} is not supported"):
            cls(*sizes, **{keyword: value})
        return
    assert status == NO_EFFECT, status
    x = torch.randn(3, sizes[0], dtype=torch.float64)
    outs = []
    for kw in ({}, {keyword: value}):
        torch.manual_seed(0)
        layer_ = cls(*sizes, params_dtype=torch.float64, **kw)
        y = layer_(x)
        y.square().sum().backward()
        outs.append([y.detach(), *(p.grad for p in layer_.parameters())])
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize(("keyword", "layer", "status"), ROWS, ids=[f"{layer}-{k}" for k, layer, _ in ROWS])
def test_documented_keyword_is_handled_as_stated(keyword, layer, status):
    check_row(keyword, layer, status)


def test_table_matches_the_code_and_covers_te():
    code = {(k.name, layer, k.status) for k in TE_KEYWORDS for layer in k.modules}
    assert set(ROWS) == code and len(ROWS) == len(code)
    for layer, names in TE_SIGNATURES.items():
        documented = {k for k, lay, _ in ROWS if lay == layer}
        assert set(names.split()) == documented, (layer, set(names.split()) ^ documented)


@pytest.mark.parametrize(
    ("keyword", "layer", "wrong_status"),
    [
        ("ub_overlap_ag", "Linear", NO_EFFECT),  # it refuses True: "no effect" is wrong
        ("seq_length", "LayerNormMLP", DEFAULT_ONLY),  # it accepts 128: "default only" is wrong
        ("sp_wgrad_input", "Linear", DEFAULT_ONLY),  # splitgrad's own, not TE's (and not in NON_DEFAULT)
        ("rng_tracker_name", "LayerNormMLP", SUPPORTED),  # TE's LayerNormMLP has no such keyword
    ],
)
def test_a_wrong_row_is_rejected(keyword, layer, wrong_status):
    with pytest.raises((AssertionError, KeyError, ValueError, pytest.fail.Exception)):
        check_row(keyword, layer, wrong_status)


def test_set_parallel_mode_and_output_layer_init_method():
    mlp = splitgrad.LayerNormMLP(8, 16, set_parallel_mode=True, output_layer_init_method=torch.nn.init.zeros_)
    assert torch.count_nonzero(mlp.fc2_weight) == 0 and torch.count_nonzero(mlp.fc1_weight) > 0
    torch.manual_seed(0)
    a = splitgrad.LayerNormMLP(8, 16, set_parallel_mode=False)
    torch.manual_seed(0)
    b = splitgrad.LayerNormMLP(8, 16)
    assert all(
        torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters())
    )  # one rank: no split either way
    assert "name='mlp1'" in repr(splitgrad.LayerNormMLP(8, 16, name="mlp1"))
