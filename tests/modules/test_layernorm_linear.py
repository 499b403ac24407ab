"""splitgrad.LayerNormLinear meets the split contract for every option.

Why: the norm is fused into the module's autograd Function, so its gradients (returned in the main backward)
and the deferred linear wgrad must both stay exactly what plain ``LayerNorm -> Linear`` autograd computes.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

import splitgrad
from tests.modules import harness as h

OPTIONS = {
    "ln": {},
    "rms": {"normalization": "RMSNorm"},
    "ln-zcg-nobias": {"zero_centered_gamma": True, "bias": False},
    "rms-zcg-lnout": {
        "normalization": "RMSNorm",
        "zero_centered_gamma": True,
        "return_layernorm_output": True,
    },
    "ln-lnout-3d": {"return_layernorm_output": True, "x_shape": (2, 3, 8)},
}


def _reference(opts: dict, p: dict, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    ln = h.module_norm_reference(opts, p, x)
    y = F.linear(ln, p["weight"], p.get("bias"))
    return (y, ln) if opts.get("return_layernorm_output") else (y,)


def _call(module, x):
    out = module(x)
    return out if isinstance(out, tuple) else (out,)


def make_case(name: str) -> h.Case:
    opts = dict(OPTIONS[name])
    x_shape = opts.pop("x_shape", (6, 8))
    return h.Case(
        name=name,
        make=functools.partial(splitgrad.module.LayerNormLinear, 8, 5, **opts),
        x_shape=x_shape,
        call=_call,
        reference=functools.partial(_reference, opts),
    )


CASES = [make_case(n) for n in OPTIONS]


(
    test_float64_matches_plain_torch,
    test_delayed_is_bitwise_immediate,
    test_delayed_is_bitwise_immediate_bf16,
) = h.correctness_tests(CASES, bf16_case=CASES[1])


@pytest.mark.parametrize("case", CASES[:2], ids=str)
def test_contract(case):
    h.check_contract(case)


@pytest.mark.parametrize("mode", ["delayed", "fused_delayed", "immediate"])
@pytest.mark.parametrize(
    "frozen", [["weight"], ["layer_norm_weight", "layer_norm_bias"], ["weight", "bias"]], ids=str
)
def test_frozen_parameters(frozen, mode):
    h.check_frozen(CASES[0], frozen, mode=mode)


def test_fully_frozen_linear_parks_nothing():
    module = h.build(CASES[0], "delayed", torch.float64)
    module.weight.requires_grad_(False)
    module.bias.requires_grad_(False)
    x = torch.randn(6, 8, dtype=torch.float64, requires_grad=True)
    module(x).sum().backward()
    assert splitgrad.pending_wgrad(module) == 0 and module.layer_norm_weight.grad is not None
    with pytest.raises(RuntimeError, match="no pending weight-gradient work"):
        module.backward_dw()


def test_only_layernorm_output_used_still_owes_one_task():
    """If only ln_out reaches the loss the linear owes zeros, like an unused-branch parameter would get."""
    module = h.build(CASES[4], "delayed", torch.float64)
    x = torch.randn(6, 8, dtype=torch.float64, requires_grad=True)
    _, ln_out = module(x)
    ln_out.sum().backward()
    assert splitgrad.backward_dw(module) == 1
    assert torch.count_nonzero(module.weight.grad) == 0 and module.layer_norm_weight.grad is not None


def test_rejects_wrong_answer():
    h.check_rejects_wrong_answer(CASES[0])


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="normalization"):
        splitgrad.module.LayerNormLinear(8, 4, normalization="BatchNorm")
    with pytest.raises(ValueError, match="in_features=8"):
        splitgrad.module.LayerNormLinear(8, 4)(torch.randn(3, 7))
    assert splitgrad.module.LayerNormLinear(8, 4, normalization="RMSNorm").layer_norm_bias is None


def test_default_init_is_identity_norm_and_nn_linear():
    torch.manual_seed(0)
    ref = torch.nn.Linear(8, 4)
    torch.manual_seed(0)
    module = splitgrad.module.LayerNormLinear(8, 4)
    # The norm's init draws no random numbers, so the linear's draws match nn.Linear's.
    assert torch.equal(module.weight, ref.weight) and torch.equal(module.bias, ref.bias)
    assert torch.equal(module.layer_norm_weight, torch.ones(8))
    zcg = splitgrad.module.LayerNormLinear(8, 4, zero_centered_gamma=True)
    assert torch.equal(zcg.layer_norm_weight, torch.zeros(8))
