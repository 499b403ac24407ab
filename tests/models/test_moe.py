"""The MoE GPT against its plain-autograd twin: routing, permutation, experts and the injected aux loss.

Why: the MoE layer sorts token copies by expert, runs GroupedLinear on the groups, unpermutes, and adds the
load-balancing gradient through an autograd trick instead of the loss. The twin loops over experts with
boolean masks and adds the aux loss to the objective explicitly, so agreement in float64 checks all three;
delayed mode must be bitwise equal to immediate (the routing and the dgrads are the same arithmetic).
"""

from __future__ import annotations

import pytest
import torch

import splitgrad
from splitgrad.models import MoEGPT, lm_loss, moe_aux_loss, moe_layers, reference_twin, set_aux_loss_scale
from tests.helpers import grads
from tests.models.helpers import assert_grads, batch, build, gpt_config, moe_config, train_step

VARIANTS = {
    "top2-gelu": ({}, (2, 16)),
    "top1-swiglu-nobias": ({"top_k": 1, "activation": "swiglu", "bias": False}, (2, 16)),
    "top2-normalized-rmsnorm": ({"norm_topk_prob": True, "normalization": "RMSNorm"}, (2, 16)),
    # 4 tokens over 8 experts: several experts get no token (empty GroupedLinear groups).
    "idle-experts": ({"num_experts": 8, "top_k": 1}, (1, 4)),
    # The benchmark switch: round-robin experts, learned weights (and aux loss) still differentiated.
    "forced-balance": ({"router_force_load_balancing": True, "norm_topk_prob": True}, (2, 16)),
    # One grouped weight and bias per expert GEMM (Megatron-Core's moe_single_grouped_weight), idle experts too.
    "single-grouped-weight": ({"moe_single_grouped_weight": True, "num_experts": 8, "top_k": 1}, (1, 6)),
}


@pytest.mark.parametrize("variant", VARIANTS, ids=list(VARIANTS))
def test_moe_matches_twin_and_delayed_is_bitwise_immediate(variant):
    overrides, (b, s) = VARIANTS[variant]
    config = moe_config(**overrides)
    ids, targets = batch(config, batch_size=b, seq=s)
    model = build(MoEGPT, config)
    twin = reference_twin(model)

    ce = train_step(model, ids, targets, delayed=False)
    ref_total = twin.loss(ids, targets)
    ref_total.backward()
    torch.testing.assert_close(ce + moe_aux_loss(model), ref_total.detach(), rtol=1e-12, atol=0)
    immediate = grads(model)
    assert_grads(immediate, grads(twin))
    for layer in moe_layers(model):
        assert sum(layer.last_tokens_per_expert) == b * s * config.top_k
    if variant == "single-grouped-weight":  # the twin read the one (experts, out, in) tensor per GEMM
        assert {n for n in immediate if ".mlp.fc" in n} == {
            f"blocks.{i}.mlp.{fc}.{part}"
            for i in range(config.num_layers)
            for fc in ("fc1", "fc2")
            for part in ("weight", "bias")
        }
    if variant in ("idle-experts", "single-grouped-weight"):
        assert any(n == 0 for layer in moe_layers(model) for n in layer.last_tokens_per_expert)

    delayed = build(MoEGPT, moe_config(**overrides, delay_wgrad_compute=True))
    train_step(delayed, ids, targets, delayed=True)
    assert_grads(grads(delayed), immediate, exact=True)


def test_aux_loss_gradient_is_injected_with_its_scale():
    config = moe_config()
    ids, targets = batch(config)
    model = build(MoEGPT, config)
    set_aux_loss_scale(model, 0.25)
    twin_scaled, twin_without = reference_twin(model), reference_twin(model)
    train_step(model, ids, targets, delayed=False)
    twin_scaled.loss(ids, targets, aux_scale=0.25).backward()
    twin_without.loss(ids, targets, aux_scale=0.0).backward()
    assert_grads(grads(model), grads(twin_scaled))
    # Not trivially passing: without the aux term even the last layer's router gradient differs.
    last_router = {k: v for k, v in grads(model).items() if k.startswith("blocks.1.mlp.router")}
    without = {k: v for k, v in grads(twin_without).items() if k in last_router}
    with pytest.raises(AssertionError, match=r"blocks\.1\.mlp\.router\.weight: Tensor-likes are not close"):
        assert_grads(last_router, without)


def test_aux_loss_of_balanced_routing_is_the_coefficient():
    layer = moe_layers(build(MoEGPT, moe_config(num_experts=4, top_k=2, aux_loss_coef=0.3)))[0]
    probs = torch.full((8, 4), 0.25, dtype=torch.float64)
    counts = torch.tensor([4, 4, 4, 4])
    torch.testing.assert_close(layer.router.aux_loss(probs, counts), torch.tensor(0.3, dtype=torch.float64))
    skewed = layer.router.aux_loss(
        torch.tensor([[1.0, 0, 0, 0]] * 8, dtype=torch.float64), torch.tensor([8, 8, 0, 0])
    )
    assert skewed > 0.3, "a collapsed router must cost more than a balanced one"


def test_forced_load_balancing_routes_round_robin_and_keeps_router_gradients():
    config = moe_config(router_force_load_balancing=True)
    ids, targets = batch(config, batch_size=2, seq=6)  # 12 tokens x top-2 over 4 experts: 6 copies each
    model = build(MoEGPT, config)
    train_step(model, ids, targets, delayed=False)
    for layer in moe_layers(model):
        assert layer.last_tokens_per_expert == [6, 6, 6, 6]
        assert layer.router.weight.grad is not None and layer.router.weight.grad.abs().sum() > 0
    # Not the learned choice: the same weights routed by their scores load the experts unevenly.
    learned = build(MoEGPT, moe_config())
    learned.load_state_dict(model.state_dict())
    train_step(learned, ids, targets, delayed=False)
    assert any(layer.last_tokens_per_expert != [6, 6, 6, 6] for layer in moe_layers(learned))
    # T * k not divisible by E: at most one copy apart.
    ids, targets = batch(config, batch_size=1, seq=5)
    with torch.no_grad():
        model(ids)
    for layer in moe_layers(model):
        assert sorted(layer.last_tokens_per_expert) == [2, 2, 3, 3]


def test_permutation_keeps_each_token_with_its_experts():
    # Routing is per token, so a batch's output must equal its tokens' outputs computed one at a time: a mix-up
    # in the sort/unsort would hand a token another token's expert output.
    config = moe_config(num_layers=1)
    model = build(MoEGPT, config)
    layer = moe_layers(model)[0]
    x = torch.randn(1, 6, config.hidden_size, dtype=torch.float64)
    with torch.no_grad():
        together = layer(x)
        alone = torch.cat([layer(x[:, t : t + 1]) for t in range(6)], dim=1)
    torch.testing.assert_close(together, alone, rtol=1e-12, atol=1e-14)


def test_moe_requires_moe_config():
    with pytest.raises(TypeError, match="MoEConfig"):
        MoEGPT(gpt_config())
    with pytest.raises(ValueError, match="top_k"):
        moe_config(top_k=5)
    with pytest.raises(ValueError, match="scale"):
        set_aux_loss_scale(build(MoEGPT, moe_config()), -1.0)


def test_delayed_moe_parks_router_and_expert_wgrads():
    model = build(MoEGPT, moe_config(delay_wgrad_compute=True))
    ids, targets = batch(model.config)
    lm_loss(model(ids), targets).backward()
    layer = moe_layers(model)[0]
    for module in (layer.router, layer.fc1, layer.fc2):
        assert len(module.wgrad_store) == 1
        assert all(p.grad is None for p in module.get_backward_dw_params())
    assert splitgrad.backward_dw(model) == len(list(splitgrad.split_modules(model)))
    assert splitgrad.pending_wgrad(model) == 0
