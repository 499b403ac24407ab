"""The GPT against its plain-autograd twin, immediate and delayed, plus its input checks.

Why: the models feed the demo, the pipeline runtime and the benchmarks; if the model built from splitgrad
layers (fused norms, split backward, SDPA) drifted from the textbook computation, every downstream result
would be wrong. The twin is written independently (explicit norms, masked softmax attention), so agreement
in float64 checks both the layers and the model wiring; delayed mode must be bitwise equal to immediate.
"""

from __future__ import annotations

import pytest
import torch

import splitgrad
from splitgrad.models import GPT, lm_loss, reference_twin
from tests.helpers import attach_main_grad, grads
from tests.models.helpers import assert_grads, batch, build, gpt_config, train_step

VARIANTS = {
    "gelu-layernorm": {},
    "swiglu-rmsnorm-tied-nobias": {"activation": "swiglu", "normalization": "RMSNorm", "tie_embeddings": True,
                                   "bias": False},
    "geglu-zero-centered": {"activation": "geglu", "zero_centered_gamma": True},
    "relu-rmsnorm": {"activation": "relu", "normalization": "RMSNorm"},
}  # fmt: skip


@pytest.mark.parametrize("variant", VARIANTS, ids=list(VARIANTS))
def test_gpt_matches_twin_and_delayed_is_bitwise_immediate(variant):
    config = gpt_config(**VARIANTS[variant])
    ids, targets = batch(config, seq=12)  # shorter than seq_len: positions are sliced
    model = build(GPT, config)
    twin = reference_twin(model)

    loss = train_step(model, ids, targets, delayed=False)
    ref_loss = twin.loss(ids, targets)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-12, atol=0)
    immediate = grads(model)
    assert_grads(immediate, grads(twin))

    delayed_model = build(GPT, gpt_config(**VARIANTS[variant], delay_wgrad_compute=True))
    logits = delayed_model(ids)
    lm_loss(logits, targets).backward()
    deferred = [p for _, m in splitgrad.split_modules(delayed_model) for p in m.get_backward_dw_params()]
    assert deferred and all(p.grad is None for p in deferred), (
        "delayed weights got gradients before backward_dw"
    )
    # One backward: every split layer (qkv, proj, mlp per block; the untied head) parked exactly one task.
    assert splitgrad.pending_wgrad(delayed_model) == len(list(splitgrad.split_modules(delayed_model)))
    splitgrad.backward_dw(delayed_model)
    assert_grads(grads(delayed_model), immediate, exact=True)


def test_twin_comparison_rejects_a_wrong_parameter():
    config = gpt_config()
    ids, targets = batch(config)
    model = build(GPT, config)
    twin = reference_twin(model)
    with torch.no_grad():
        twin.get_parameter("blocks.1.mlp.fc1_weight")[0, 0] += 1e-6
    train_step(model, ids, targets, delayed=False)
    twin.loss(ids, targets).backward()
    with pytest.raises(AssertionError, match="not close"):
        assert_grads(grads(model), grads(twin))


def test_fused_main_grad_matches_twin():
    config = gpt_config(delay_wgrad_compute=True, fuse_wgrad_accumulation=True)
    ids, targets = batch(config)
    model = build(GPT, config)
    twin = reference_twin(model)
    fused = attach_main_grad(model, fill=0.0)
    train_step(model, ids, targets, delayed=True)
    twin.loss(ids, targets).backward()
    assert fused and all(p.grad is None for p in fused), "no gradient went through main_grad"
    # grads() reads main_grad where a weight has one and refuses a parameter holding both.
    assert_grads(grads(model), grads(twin))


def test_capture_bundle_holds_the_whole_model_wgrad():
    config = gpt_config(delay_wgrad_compute=True)
    ids, targets = batch(config)
    model = build(GPT, config)
    reference = build(GPT, gpt_config())
    train_step(reference, ids, targets, delayed=False)
    with splitgrad.capture_wgrad() as bundle:
        lm_loss(model(ids), targets).backward()
    assert splitgrad.queued_wgrad(model) == 0 and len(bundle) > 0
    bundle.run()
    assert_grads(grads(model), grads(reference), exact=True)


def test_dropout_is_off_in_eval_and_twin_refuses_training_dropout():
    model = build(GPT, gpt_config(dropout=0.5))
    ids, _ = batch(model.config)
    twin = reference_twin(model)
    model.eval()
    twin.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(ids), twin(ids)[0], rtol=1e-10, atol=1e-12)
        model.train()
        assert not torch.allclose(model(ids), twin(ids)[0]), "dropout=0.5 in training mode changed nothing"
    twin.train()
    with pytest.raises(RuntimeError, match="no dropout"):
        twin(ids)


def test_initialisation_follows_gpt2():
    torch.manual_seed(0)
    config = gpt_config(num_layers=8, hidden_size=64, ffn_hidden_size=256, init_std=0.02)
    model = GPT(config)
    assert torch.equal(model.head.norm.weight, torch.ones_like(model.head.norm.weight))
    assert not model.blocks[0].attn.qkv.bias.any() and not model.blocks[0].mlp.fc1_bias.any()
    std_in = model.blocks[0].mlp.fc1_weight.std().item()
    std_out = model.blocks[0].mlp.fc2_weight.std().item()
    assert abs(std_in - 0.02) < 0.002 and abs(std_out - 0.02 / 4) < 0.0005, (std_in, std_out)


def test_bad_inputs_are_rejected_with_clear_errors():
    model = build(GPT, gpt_config())
    with pytest.raises(ValueError, match="int64"):
        model(torch.zeros(2, 4))
    with pytest.raises(ValueError, match="longer than seq_len=16"):
        model(torch.zeros(2, 17, dtype=torch.long))
    with pytest.raises(ValueError, match="targets"):
        lm_loss(torch.zeros(2, 4, 37), torch.zeros(2, 5, dtype=torch.long))
