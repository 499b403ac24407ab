"""Every transformers MoE family ``convert`` knows: what it converts, leaves alone or names — the table of
``docs/hf_moe.md`` — and, for each family it converts, the same loss and gradients as the original model.

Why: the experts integration covers ~60 classes whose layouts differ (concatenated or interleaved gate/up,
transposed weights, biases, no gate, clamped or softcapped activations). ``convert`` reads the decorator's
flags instead of a per-family table, so every family we can build is checked, not just the four the issue
names. Families outside the integration must not break ``convert`` and must be named, not silently skipped;
routers (some are ``nn.Linear`` subclasses with their own ``forward``) must stay as they are.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import nn

import splitgrad
from splitgrad.integrations.transformers import SplitExperts

from . import hf_tiny

F64 = {"rtol": 1e-9, "atol": 1e-11}
CORE = {"mixtral", "qwen3_moe", "deepseek_v3", "gpt_oss"}  # checked in depth by test_hf_experts.py

# family -> (experts classes converted, linears left alone by convert, experts named in the warning)
TABLE = {
    "phimoe": ({"PhimoeExperts"}, {"PhimoeTopKRouter"}, set()),
    "jamba": ({"JambaExperts"}, {"dt_proj"}, set()),
    "nemotron_h": ({"NemotronHExperts"}, set(), set()),  # built without Mamba2 layers (hf_tiny)
    "granitemoehybrid": ({"GraniteMoeHybridExperts"}, {"out_proj"}, set()),  # Mamba2's fused kernel reads it
    "aria_text": ({"AriaExperts"}, set(), set()),
    "llama4_text": (set(), {"Llama4Router"}, {"Llama4TextExperts"}),
    "dbrx": (set(), set(), {"DbrxExpertGLU"}),
    "jetmoe": (set(), set(), {"JetMoeParallelExperts"}),
    "longcat_flash": (set(), {"classifier"}, {"LongcatFlashExperts"}),
}


def _converted_experts(model) -> set[str]:
    return {type(m).__name__.removeprefix("Split") for m in model.modules() if isinstance(m, SplitExperts)}


def _left_linears(model) -> set[str]:
    """Linears convert did not swap: their class name, or their attribute name for plain nn.Linear."""
    left = set()
    for parent in model.modules():
        for name, child in parent.named_children():
            if isinstance(child, nn.Linear):
                left.add(name if type(child) is nn.Linear else type(child).__name__)
    return left


@pytest.mark.parametrize("family", sorted(set(hf_tiny.DECORATED) - CORE))
def test_every_decorated_family_trains_like_the_original(family):
    """float64 against transformers' eager experts: loss and every gradient; experts deferred, one task each."""
    reference = hf_tiny.model(family)
    model = splitgrad.convert(copy.deepcopy(reference))
    layers = [m for m in model.modules() if isinstance(m, SplitExperts)]
    assert layers, f"{family}: no experts converted"
    ids = hf_tiny.batch()
    want = reference(input_ids=ids, labels=ids).loss
    want.backward()
    got = model(input_ids=ids, labels=ids).loss
    got.backward()
    assert [m.wgrad_store.outstanding.queued for m in layers] == [1] * len(layers)
    splitgrad.backward_dw(model)
    torch.testing.assert_close(got, want, **F64)
    ref = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        if ref[name].grad is None:
            assert p.grad is None, f"{family} {name}"
            continue
        torch.testing.assert_close(p.grad, ref[name].grad, **F64, msg=lambda m, n=name: f"{family} {n}: {m}")
    # Negative check: the same comparison rejects the gradients of experts 0 and 1 swapped in one layer.
    w = layers[0].down_proj
    want_w = ref[next(n for n, q in model.named_parameters() if q is w)].grad
    with pytest.raises(AssertionError):
        torch.testing.assert_close(w.grad[[1, 0, *range(2, w.shape[0])]], want_w, **F64)


@pytest.mark.parametrize("family", sorted(TABLE))
def test_what_convert_converts_leaves_alone_or_names(family, caplog):
    experts_converted, linears_left, named = TABLE[family]
    model = hf_tiny.model(family)
    with caplog.at_level(logging.WARNING, logger="splitgrad.convert"):
        splitgrad.convert(model)
    assert _converted_experts(model) == experts_converted
    assert _left_linears(model) == linears_left
    warned = " ".join(r.getMessage() for r in caplog.records)
    for cls in named:
        assert cls in warned and "not deferred" in warned, warned
    if not named:
        assert "outside transformers' experts integration" not in warned
    # The converted model still trains: one step, all deferred work drained, every trainable parameter has a grad.
    model(input_ids=hf_tiny.batch(), labels=hf_tiny.batch()).loss.backward()
    splitgrad.backward_dw(model)
    splitgrad.ensure_no_pending_wgrad(model)
    assert splitgrad.pending_wgrad(model) == 0


def test_a_router_left_alone_keeps_its_forward_and_plain_autograd():
    """PhimoeTopKRouter subclasses nn.Linear with its own forward: convert must neither fail nor swap it."""
    model = splitgrad.convert(hf_tiny.model("phimoe"))
    router = model.model.layers[0].mlp.router
    assert type(router).__name__ == "PhimoeTopKRouter"
    assert not getattr(router.weight, "skip_backward_post_hook", False)
    model(input_ids=hf_tiny.batch(), labels=hf_tiny.batch()).loss.backward()
    assert router.weight.grad is not None  # written by autograd, before any backward_dw
    splitgrad.backward_dw(model)


def test_experts_with_unknown_parameters_are_refused_by_name():
    model = hf_tiny.model("mixtral")
    layer = model.model.layers[1].mlp.experts
    layer.scale = nn.Parameter(torch.ones(8))
    with pytest.raises(ValueError, match=r"'model\.layers\.1\.mlp\.experts' \(MixtralExperts\).*scale"):
        splitgrad.convert(model)
    assert not any(isinstance(m, SplitExperts) for m in model.modules())  # nothing converted
    assert all(type(m) is not splitgrad.Linear for m in model.modules())
    splitgrad.convert(model, skip=["model.layers.1.mlp.experts"])
    assert _converted_experts(model) == {"MixtralExperts"}
    assert not isinstance(layer, SplitExperts)


def test_importing_and_converting_a_plain_model_does_not_import_transformers():
    import subprocess
    import sys

    probe = (
        "import sys, torch, splitgrad\n"
        "splitgrad.convert(torch.nn.Sequential(torch.nn.Linear(2, 2)))\n"
        "print('transformers' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, check=True
    )
    assert out.stdout.strip() == "False", out.stderr
