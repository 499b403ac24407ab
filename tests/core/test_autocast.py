"""torch.autocast: split modules compute in the autocast dtype and write fp32 gradients.

Why: a custom autograd Function is opaque to autocast; without explicit casting, bf16 activations meet fp32
weights and the backward fails ("expected m1 and m2 to have the same dtype").
"""

from __future__ import annotations

import pytest
import torch

import splitgrad
from tests.core.helpers import assert_same
from tests.helpers import grads


def _build(kind: str, delay: bool) -> tuple[torch.nn.Module, callable]:
    torch.manual_seed(0)
    if kind == "Linear":
        return splitgrad.Linear(16, 8, delay_wgrad_compute=delay), lambda m, x: m(x)
    if kind == "LayerNormLinear":
        return splitgrad.LayerNormLinear(16, 8, delay_wgrad_compute=delay), lambda m, x: m(x)
    if kind == "LayerNormMLP":
        return splitgrad.LayerNormMLP(16, 32, activation="swiglu", delay_wgrad_compute=delay), lambda m, x: m(
            x
        )
    return splitgrad.GroupedLinear(3, 16, 8, delay_wgrad_compute=delay), lambda m, x: m(x, [2, 0, 4])


@pytest.mark.parametrize("kind", ["Linear", "LayerNormLinear", "LayerNormMLP", "GroupedLinear"])
def test_autocast_bf16_delayed_matches_immediate_and_grads_are_fp32(kind):
    results = []
    for delay in (False, True):
        module, call = _build(kind, delay)
        x = torch.randn(6, 16, generator=torch.Generator().manual_seed(1), requires_grad=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = call(module, x)
        assert y.dtype == torch.bfloat16
        y.float().square().sum().backward()
        splitgrad.backward_dw(module)
        assert x.grad.dtype == torch.float32
        assert all(p.grad.dtype == torch.float32 for p in module.parameters())
        results.append(grads(module) | {"x": x.grad.clone()})
    assert_same(*results, exact=True)


def test_autocast_linear_matches_torch_linear_under_autocast():
    torch.manual_seed(0)
    ref = torch.nn.Linear(16, 8)
    layer = splitgrad.Linear(16, 8, delay_wgrad_compute=True)
    layer.load_state_dict(ref.state_dict())
    x = torch.randn(6, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y_ref, y = ref(x), layer(x)
    torch.testing.assert_close(y, y_ref, rtol=0, atol=0)  # the same casts and the same bf16 GEMM
    y_ref.float().sum().backward()
    y.float().sum().backward()
    layer.backward_dw()
    torch.testing.assert_close(layer.weight.grad, ref.weight.grad, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(layer.bias.grad, ref.bias.grad, rtol=1e-2, atol=1e-2)
