"""TE's tensor-parallel constructor keywords on one process: today's behaviour bit for bit, return_bias,
init_method, and clear errors.

Why: the README promises Megatron/TE-style code ports unchanged; these keywords used to raise TypeError, and a
one-rank configuration (or ``tp_group=None``) must not change a single bit of what the layer computes.
"""

from __future__ import annotations

import pytest
import torch

import splitgrad

F64 = torch.float64


def _step(layer: splitgrad.Linear, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    out = layer(x)
    y = out[0] + out[1] if isinstance(out, tuple) else out
    y.square().sum().backward()
    splitgrad.backward_dw(layer)
    return y.detach(), layer.weight.grad, layer.bias.grad


@pytest.mark.parametrize("delay", [False, True])
@pytest.mark.parametrize(
    "kw",
    [
        {"tp_group": None},
        {"tp_size": 1, "parallel_mode": "column"},
        {"tp_size": 1, "parallel_mode": "row", "sequence_parallel": True},
        {"parallel_mode": "column", "return_bias": True},
    ],
)
def test_one_rank_is_todays_layer_bit_for_bit(kw, delay):
    x = torch.randn(5, 3, 8, dtype=F64)
    torch.manual_seed(3)
    plain = splitgrad.Linear(8, 6, params_dtype=F64, delay_wgrad_compute=delay)
    torch.manual_seed(3)
    tp = splitgrad.Linear(8, 6, params_dtype=F64, delay_wgrad_compute=delay, **kw)
    for a, b in zip(plain.parameters(), tp.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # same seeded initialisation
    for a, b in zip(_step(plain, x), _step(tp, x)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    ref = torch.nn.Linear(8, 6, dtype=F64)  # and plain autograd, in float64
    with torch.no_grad():
        ref.weight.copy_(plain.weight)
        ref.bias.copy_(plain.bias)
    ref(x).square().sum().backward()
    torch.testing.assert_close(tp.weight.grad, ref.weight.grad, rtol=1e-12, atol=1e-12)
    assert not torch.allclose(tp.weight.grad, 2 * ref.weight.grad)  # negative: a doubled gradient is rejected


def test_return_bias_leaves_the_bias_to_autograd():
    layer = splitgrad.Linear(4, 3, return_bias=True, delay_wgrad_compute=True, params_dtype=F64)
    x = torch.randn(2, 4, dtype=F64)
    y, bias = layer(x)
    assert bias is layer.bias
    torch.testing.assert_close(y, x @ layer.weight.detach().T, rtol=0, atol=0)  # the bias is not added
    assert layer.get_backward_dw_params() == [layer.weight]
    assert not getattr(layer.bias, "skip_backward_post_hook", False)  # autograd accumulates it
    (y + bias).sum().backward()
    torch.testing.assert_close(layer.bias.grad, torch.full((3,), 2.0, dtype=F64), rtol=0, atol=0)
    assert layer.weight.grad is None and splitgrad.pending_wgrad(layer) == 1
    splitgrad.backward_dw(layer)
    torch.testing.assert_close(layer.weight.grad, torch.ones(3, 2, dtype=F64) @ x, rtol=0, atol=0)


def test_init_method_gets_the_local_weight_and_zeroes_the_bias():
    seen = []

    def init(weight: torch.Tensor) -> None:
        seen.append(tuple(weight.shape))
        torch.nn.init.constant_(weight, 0.5)

    layer = splitgrad.Linear(4, 3, init_method=init)
    assert seen == [(3, 4)]
    assert torch.equal(layer.weight, torch.full((3, 4), 0.5)) and torch.equal(layer.bias, torch.zeros(3))


@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        ({"tp_size": 2}, "needs tp_group"),
        ({"tp_size": 0}, "tp_size must be a positive int"),
        ({"parallel_mode": "col"}, "parallel_mode must be one of"),
        ({"sp_wgrad_input": "both"}, "sp_wgrad_input"),
    ],
)
def test_bad_keywords_are_value_errors(kw, needle):
    with pytest.raises(ValueError, match=needle):
        splitgrad.Linear(4, 4, **kw)
