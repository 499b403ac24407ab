"""splitgrad.Linear numerics: delayed vs immediate bitwise, and float64 agreement with plain autograd.

Why: every later feature (modules, DDP, pipelines, graphs) assumes deferring the weight gradient changes
*when* it is computed, never *what* is computed.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

import splitgrad
from tests.core.helpers import assert_same
from tests.helpers import attach_main_grad, grads

SHAPES = {"2d": (12,), "3d": (3, 5)}


def _run(delay: bool, fused: bool, dtype: torch.dtype, lead: tuple[int, ...], bias: bool, n_mb: int = 2):
    torch.manual_seed(0)
    layer = splitgrad.Linear(
        16, 8, bias=bias, delay_wgrad_compute=delay, fuse_wgrad_accumulation=fused, params_dtype=dtype
    )
    if fused:
        attach_main_grad(layer, dtype=torch.float32)  # Megatron's fp32 buffers, whatever the params
    dxs = []
    for mb in range(n_mb):
        x = torch.randn(*lead, 16, dtype=dtype, generator=torch.Generator().manual_seed(mb)).requires_grad_()
        dy = torch.randn(*lead, 8, dtype=dtype, generator=torch.Generator().manual_seed(100 + mb))
        y = layer(x)
        y.backward(dy)
        dxs.append(x.grad.clone())
        if delay:
            assert splitgrad.pending_wgrad(layer) == 1
            layer.backward_dw()
    return y.detach(), dxs, grads(layer)


@pytest.mark.parametrize(
    "dtype,shape,bias,fused",
    list(
        itertools.product(
            [torch.float32, torch.float64, torch.bfloat16], SHAPES, [True, False], [False, True]
        )
    ),
)
def test_delayed_matches_immediate_bitwise(dtype, shape, bias, fused):
    y0, dx0, g0 = _run(False, fused, dtype, SHAPES[shape], bias)
    y1, dx1, g1 = _run(True, fused, dtype, SHAPES[shape], bias)
    torch.testing.assert_close(y0, y1, rtol=0, atol=0)
    for a, b in zip(dx0, dx1):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert_same(g0, g1, exact=True)


@pytest.mark.parametrize("delay,bias,shape", list(itertools.product([False, True], [True, False], SHAPES)))
def test_float64_agrees_with_plain_autograd(delay, bias, shape):
    torch.manual_seed(1)
    layer = splitgrad.Linear(16, 8, bias=bias, delay_wgrad_compute=delay, params_dtype=torch.float64)
    w = layer.weight.detach().clone().requires_grad_()
    b = layer.bias.detach().clone().requires_grad_() if bias else None
    x = torch.randn(*SHAPES[shape], 16, dtype=torch.float64, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    dy = torch.randn(*SHAPES[shape], 8, dtype=torch.float64)

    y = layer(x)
    y.backward(dy)
    splitgrad.backward_dw(layer)
    y_ref = F.linear(x_ref, w, b)
    y_ref.backward(dy)

    tol = {"rtol": 1e-12, "atol": 1e-12}
    torch.testing.assert_close(y, y_ref, **tol)
    torch.testing.assert_close(x.grad, x_ref.grad, **tol)
    torch.testing.assert_close(layer.weight.grad, w.grad, **tol)
    if bias:
        torch.testing.assert_close(layer.bias.grad, b.grad, **tol)
    else:
        assert layer.bias is None


def test_matches_torch_nn_linear_state_dict_and_init():
    torch.manual_seed(3)
    ref = torch.nn.Linear(7, 5)
    torch.manual_seed(3)
    layer = splitgrad.Linear(7, 5)
    assert_same(dict(ref.state_dict()), dict(layer.state_dict()), exact=True)
    other = splitgrad.Linear(7, 5, bias=False)
    missing = other.load_state_dict({"weight": ref.weight.detach()}, strict=True)
    assert not missing.missing_keys
    x = torch.randn(4, 7)
    torch.testing.assert_close(layer(x), ref(x), rtol=0, atol=0)


def test_microbatch_accumulation_matches_autograd_sum():
    torch.manual_seed(4)
    layer = splitgrad.Linear(6, 4, delay_wgrad_compute=True, params_dtype=torch.float64)
    ref = torch.nn.Linear(6, 4, dtype=torch.float64)
    ref.load_state_dict(layer.state_dict())
    xs = [torch.randn(5, 6, dtype=torch.float64) for _ in range(3)]
    for x in xs:
        layer(x).pow(2).sum().backward()
        ref(x).pow(2).sum().backward()
    assert splitgrad.pending_wgrad(layer) == 3
    assert splitgrad.backward_dw(layer) == 3
    assert splitgrad.pending_wgrad(layer) == 0
    assert_same(grads(layer), grads(ref), exact=False)


def test_tied_use_accumulates_both_uses():
    """One module used twice in one forward: TE overwrites / fills bias only if None; we must sum."""
    torch.manual_seed(5)
    layer = splitgrad.Linear(4, 4, delay_wgrad_compute=True, params_dtype=torch.float64)
    ref = torch.nn.Linear(4, 4, dtype=torch.float64)
    ref.load_state_dict(layer.state_dict())
    x = torch.randn(3, 4, dtype=torch.float64)
    layer(torch.tanh(layer(x))).sum().backward()
    ref(torch.tanh(ref(x))).sum().backward()
    assert splitgrad.pending_wgrad(layer) == 2
    assert splitgrad.backward_dw(layer) == 2
    assert_same(grads(layer), grads(ref), exact=False)


def test_tied_use_immediate_equals_delayed_bitwise():
    outs = []
    for delay in (False, True):
        torch.manual_seed(6)
        layer = splitgrad.Linear(4, 4, delay_wgrad_compute=delay)
        x = torch.randn(3, 4)
        layer(torch.tanh(layer(x))).sum().backward()
        splitgrad.backward_dw(layer)
        outs.append(grads(layer))
    assert_same(*outs, exact=True)


def test_no_input_grad_and_frozen_weight():
    torch.manual_seed(7)
    layer = splitgrad.Linear(4, 3, delay_wgrad_compute=True)
    layer.weight.requires_grad_(False)
    x = torch.randn(2, 4)  # first layer: no input gradient wanted
    layer(x).sum().backward()
    assert layer.get_backward_dw_params() == [layer.bias]
    layer.backward_dw()
    assert layer.weight.grad is None
    torch.testing.assert_close(layer.bias.grad, torch.full((3,), 2.0))

    layer.bias.requires_grad_(False)
    x = torch.randn(2, 4, requires_grad=True)
    layer(x).sum().backward()
    # Nothing trainable to defer: no task is queued, so nothing can be forgotten either.
    assert splitgrad.pending_wgrad(layer) == 0
    assert layer.get_backward_dw_params() == []


def test_empty_token_batch():
    layer = splitgrad.Linear(4, 3, delay_wgrad_compute=True)
    x = torch.zeros(0, 4, requires_grad=True)
    layer(x).sum().backward()
    layer.backward_dw()
    torch.testing.assert_close(layer.weight.grad, torch.zeros(3, 4))
    assert x.grad.shape == (0, 4)


def test_negative_skipping_backward_dw_is_detected():
    """Not trivially passing: forgetting the W step (or overwriting) must break the comparison."""
    torch.manual_seed(8)
    layer = splitgrad.Linear(6, 4, delay_wgrad_compute=True, params_dtype=torch.float64)
    ref = torch.nn.Linear(6, 4, dtype=torch.float64)
    ref.load_state_dict(layer.state_dict())
    for _ in range(2):
        x = torch.randn(5, 6, dtype=torch.float64)
        layer(x).sum().backward()
        ref(x).sum().backward()
    layer.backward_dw()  # only one of two
    with pytest.raises(AssertionError):
        assert_same(grads(layer), grads(ref), exact=False)
    # TE-style overwrite of .grad by the second task would also be caught:
    layer.weight.grad = None
    layer.bias.grad = None
    layer.backward_dw()
    with pytest.raises(AssertionError):
        assert_same(grads(layer), grads(ref), exact=False)
