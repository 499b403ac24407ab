"""splitgrad.LayerNormMLP meets the split contract for every norm, activation and option.

Why: both fcs' weight gradients form one deferred task per backward. This checks that one ``backward_dw()``
completes both (hooks once), that frozen fcs never desynchronise the pending work (a bug TE had), and that
every gradient matches a plain ``norm -> fc1 -> act -> fc2`` written with textbook activation formulas.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
import torch.nn.functional as F

import splitgrad
from tests.modules import harness as h

OPTIONS = {
    "ln-gelu": {},
    "rms-relu": {"normalization": "RMSNorm", "activation": "relu"},
    "rms-swiglu-zcg-nobias": {
        "normalization": "RMSNorm",
        "activation": "swiglu",
        "zero_centered_gamma": True,
        "bias": False,
    },
    "ln-geglu-3d": {"activation": "geglu", "x_shape": (2, 3, 8)},
}


def _gelu_tanh(t: torch.Tensor) -> torch.Tensor:
    return 0.5 * t * (1 + torch.tanh(math.sqrt(2 / math.pi) * (t + 0.044715 * t**3)))


def _reference(opts: dict, p: dict, x: torch.Tensor) -> tuple[torch.Tensor]:
    ln = h.module_norm_reference(opts, p, x)
    hid = F.linear(ln, p["fc1_weight"], p.get("fc1_bias"))
    activation = opts.get("activation", "gelu")
    if activation == "gelu":
        act = _gelu_tanh(hid)
    elif activation == "relu":
        act = hid.clamp_min(0)
    else:
        a, b = hid.chunk(2, dim=-1)
        act = (a * torch.sigmoid(a) if activation == "swiglu" else _gelu_tanh(a)) * b
    return (F.linear(act, p["fc2_weight"], p.get("fc2_bias")),)


def make_case(name: str) -> h.Case:
    opts = dict(OPTIONS[name])
    x_shape = opts.pop("x_shape", (6, 8))
    return h.Case(
        name=name,
        make=functools.partial(splitgrad.module.LayerNormMLP, 8, 12, **opts),
        x_shape=x_shape,
        call=lambda module, x: (module(x),),
        reference=functools.partial(_reference, opts),
    )


CASES = [make_case(n) for n in OPTIONS]


(
    test_float64_matches_plain_torch,
    test_delayed_is_bitwise_immediate,
    test_delayed_is_bitwise_immediate_bf16,
) = h.correctness_tests(CASES, bf16_case=CASES[2])


@pytest.mark.parametrize("case", CASES[::2], ids=str)
def test_contract(case):
    h.check_contract(case)


FROZEN = {
    "fc1": ["fc1_weight", "fc1_bias"],
    "fc2": ["fc2_weight", "fc2_bias"],
    "fc2-weight": ["fc2_weight"],
    "norm": ["layer_norm_weight", "layer_norm_bias"],
}


@pytest.mark.parametrize("mode", ["delayed", "fused_delayed", "fused"])
@pytest.mark.parametrize("frozen", FROZEN, ids=str)
def test_frozen_parameters_keep_one_task_per_backward(frozen, mode):
    h.check_frozen(CASES[0], FROZEN[frozen], mode=mode)


def test_frozen_fc1_needs_no_main_grad():
    module = h.build(CASES[0], "fused_delayed", torch.float64)
    module.fc1_weight.requires_grad_(False)
    module.fc2_weight.main_grad = torch.zeros_like(module.fc2_weight)
    module(torch.randn(6, 8, dtype=torch.float64)).sum().backward()
    assert splitgrad.backward_dw(module) == 1
    assert module.fc1_weight.grad is None and module.fc1_bias.grad is not None
    assert module.fc2_weight.main_grad.abs().sum() > 0


def test_all_fcs_frozen_parks_nothing():
    module = h.build(CASES[0], "delayed", torch.float64)
    for name in ("fc1_weight", "fc1_bias", "fc2_weight", "fc2_bias"):
        module.get_parameter(name).requires_grad_(False)
    assert module.get_backward_dw_params() == []
    x = torch.randn(6, 8, dtype=torch.float64, requires_grad=True)
    module(x).sum().backward()
    assert splitgrad.pending_wgrad(module) == 0 and x.grad is not None
    assert module.layer_norm_weight.grad is not None


def test_gated_fc1_is_twice_as_wide():
    module = splitgrad.module.LayerNormMLP(8, 12, activation="swiglu")
    assert module.fc1_weight.shape == (24, 8) and module.fc2_weight.shape == (8, 12)


def test_rejects_wrong_answer():
    h.check_rejects_wrong_answer(CASES[1])


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="activation"):
        splitgrad.module.LayerNormMLP(8, 12, activation="tanh")
    with pytest.raises(ValueError, match="normalization"):
        splitgrad.module.LayerNormMLP(8, 12, normalization="GroupNorm")
    with pytest.raises(ValueError, match="hidden_size=8"):
        splitgrad.module.LayerNormMLP(8, 12)(torch.randn(2, 9))
