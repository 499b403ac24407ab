"""Experts classes of families with no tiny causal-LM build (vision-language or huge defaults), converted alone.

Why: their layouts are the ones the model-level sweep cannot reach — a per-expert post norm (MuseSpark),
transposed weights with biases and concatenated clamped swiglu (OpenAI privacy filter), a clamped gate
(DeepSeek-V4), a softcapped fp32 gate taking two arguments (Inkling2). The converted module must give the
outputs and gradients of transformers' own ``batched_mm`` implementation (its float64-capable fast path,
which applies ``_apply_gate`` exactly as ``grouped_mm`` does). Note the eager forwards of some of these
classes differ from transformers' own fast paths (Inkling2 accumulates in float32; the privacy filter's
eager gate differs by ~1e-5): splitgrad follows the fast paths.
"""

from __future__ import annotations

import copy
import importlib

import pytest
import torch

import splitgrad
from splitgrad.integrations.transformers import SplitExperts

CLASSES = {
    "muse_spark": ("MuseSparkExperts", "MuseSparkTextConfig", {"moe_hidden_size": 64, "moe_intermediate_size": 32,
                   "num_local_experts": 8, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}),
    "openai_privacy_filter": ("OpenAIPrivacyFilterExperts", "OpenAIPrivacyFilterConfig",
                              {"intermediate_size": 32, "num_local_experts": 8}),
    "deepseek_v4": ("DeepseekV4Experts", "DeepseekV4Config", {"moe_intermediate_size": 32, "n_routed_experts": 8}),
    "inkling2": ("Inkling2Experts", "Inkling2TextConfig", {"moe_intermediate_size": 32, "n_routed_experts": 8}),
}  # fmt: skip
TOL = {"rtol": 1e-10, "atol": 1e-10}


def _experts(family: str) -> torch.nn.Module:
    cls, config_cls, kwargs = CLASSES[family]
    modeling = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    configuration = importlib.import_module(f"transformers.models.{family}.configuration_{family}")
    config = getattr(configuration, config_cls)(hidden_size=64, **kwargs)
    config._experts_implementation = "batched_mm"
    torch.manual_seed(0)
    module = getattr(modeling, cls)(config).double()
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.uniform_(0.5, 1.5) if "norm" in name else p.normal_(std=0.2)
    return module


@pytest.mark.parametrize("family", sorted(CLASSES))
def test_converted_experts_match_transformers_batched_mm(family):
    reference = _experts(family)
    converted = splitgrad.convert(copy.deepcopy(reference))
    assert isinstance(converted, SplitExperts) and converted.need_backward_dw()
    gen = torch.Generator().manual_seed(1)
    h = torch.randn(12, 64, generator=gen, dtype=torch.float64)
    ids = torch.rand(12, 8, generator=gen).topk(2, dim=-1).indices
    w = torch.rand(12, 2, generator=gen, dtype=torch.float64)
    results = []
    for module, drain in ((reference, False), (converted, True)):
        x = h.clone().requires_grad_()
        y = module(x, ids, w)
        y.square().sum().backward()
        if drain:
            assert splitgrad.pending_wgrad(module) == 1
            module.backward_dw()
        results.append((y.detach(), x.grad, {n: p.grad for n, p in module.named_parameters()}))
    (y0, dx0, g0), (y1, dx1, g1) = results
    torch.testing.assert_close(y1, y0, **TOL)
    torch.testing.assert_close(dx1, dx0, **TOL)
    assert g1.keys() == g0.keys()
    for name in g0:
        # MuseSpark's post norm computes in float32 on purpose; its weight's gradient sums rows in another
        # order here (sorted by expert), so it agrees to float32 rounding only.
        tol = {"rtol": 1e-4, "atol": 1e-6} if "post_expert_norm" in name else TOL
        torch.testing.assert_close(g1[name], g0[name], **tol, msg=lambda m, n=name: f"{family} {n}: {m}")
    # Negative check: the comparison sees a routing weight that changed.
    with pytest.raises(AssertionError):
        torch.testing.assert_close(converted(h, ids, w * 1.01).detach(), y0, **TOL)
