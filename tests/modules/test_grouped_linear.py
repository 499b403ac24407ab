"""splitgrad.GroupedLinear (the MoE expert layer) meets the split contract, empty groups included.

Why: an expert that received no tokens must still get a (zero) gradient exactly like plain autograd gives
it, and one ``backward_dw()`` must complete every expert of one backward, whatever the routing.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

import splitgrad
from tests.helpers import attach_main_grad
from tests.modules import harness as h

OPTIONS = {
    "bias-empty-middle": {"num_gemms": 4, "splits": [3, 0, 5, 2]},
    "nobias": {"num_gemms": 3, "splits": [4, 4, 2], "bias": False},
    "3d-empty-first": {"num_gemms": 3, "splits": [0, 7, 3], "x_shape": (2, 5, 8)},
    "one-group-takes-all": {"num_gemms": 3, "splits": [0, 10, 0]},
}


def _reference(splits: list[int], p: dict, x: torch.Tensor) -> tuple[torch.Tensor]:
    x2 = x.reshape(-1, x.shape[-1])
    outs = [F.linear(xi, p[f"weight{i}"], p.get(f"bias{i}")) for i, xi in enumerate(torch.split(x2, splits))]
    return (torch.cat(outs).view(*x.shape[:-1], -1),)


def make_case(name: str) -> h.Case:
    opts = dict(OPTIONS[name])
    splits = opts.pop("splits")
    x_shape = opts.pop("x_shape", (10, 8))
    n = opts.pop("num_gemms")
    return h.Case(
        name=name,
        make=functools.partial(splitgrad.module.GroupedLinear, n, 8, 5, **opts),
        x_shape=x_shape,
        call=lambda module, x: (module(x, splits),),
        reference=functools.partial(_reference, splits),
    )


CASES = [make_case(n) for n in OPTIONS]


(
    test_float64_matches_plain_torch,
    test_delayed_is_bitwise_immediate,
    test_delayed_is_bitwise_immediate_bf16,
) = h.correctness_tests(CASES, bf16_case=CASES[0])


def test_forward_is_bitwise_a_loop_of_nn_linear():
    module = h.build(CASES[0], "immediate", torch.float32)
    x = torch.randn(10, 8)
    params = dict(module.named_parameters())
    torch.testing.assert_close(module(x, [3, 0, 5, 2]), _reference([3, 0, 5, 2], params, x)[0], **h.EXACT)


@pytest.mark.parametrize("case", CASES[:2], ids=str)
def test_contract(case):
    h.check_contract(case)


@pytest.mark.parametrize("mode", ["delayed", "fused_delayed", "immediate"])
def test_empty_group_gradients_are_accumulated_zeros(mode):
    module = h.build(CASES[0], mode, torch.float64)
    attach_main_grad(module, fill=3.0)
    module.bias0.grad = torch.ones_like(module.bias0)
    module(torch.randn(10, 8, dtype=torch.float64), [0, 4, 3, 3]).sum().backward()
    splitgrad.backward_dw(module)
    fused = mode.startswith("fused")
    w0 = module.weight0.main_grad if fused else module.weight0.grad
    torch.testing.assert_close(w0, torch.full_like(w0, 3.0) if fused else torch.zeros_like(w0), **h.EXACT)
    torch.testing.assert_close(module.bias0.grad, torch.ones_like(module.bias0), **h.EXACT)


@pytest.mark.parametrize("mode", ["delayed", "fused_delayed"])
def test_frozen_experts(mode):
    h.check_frozen(CASES[0], ["weight1", "bias1", "weight3"], mode=mode)


def test_input_modified_before_backward_dw_is_refused():
    """The deferred wgrad reads the saved input; changing it in place must fail loudly, not give wrong grads."""
    module = h.build(CASES[0], "delayed", torch.float64)
    x = torch.randn(10, 8, dtype=torch.float64)
    module(x, [3, 0, 5, 2]).sum().backward()
    x.mul_(2)
    with pytest.raises(RuntimeError, match="modified in place"):
        module.backward_dw()


def test_m_splits_may_be_a_tensor():
    module = h.build(CASES[0], "immediate", torch.float64)
    x = torch.randn(10, 8, dtype=torch.float64)
    torch.testing.assert_close(module(x, torch.tensor([3, 0, 5, 2])), module(x, [3, 0, 5, 2]), **h.EXACT)


def test_rejects_wrong_answer():
    h.check_rejects_wrong_answer(CASES[0])


@pytest.mark.parametrize("splits", [[3, 0, 5], [3, 0, 5, 1], [3, -1, 5, 3]], ids=str)
def test_bad_m_splits_are_named(splits):
    module = splitgrad.module.GroupedLinear(4, 8, 5)
    with pytest.raises(
        ValueError, match=r"m_splits must be 4 non-negative ints summing to the 10 input rows"
    ):
        module(torch.randn(10, 8), splits)


def test_parameter_names_are_te_names():
    module = splitgrad.module.GroupedLinear(2, 8, 5)
    assert [n for n, _ in module.named_parameters()] == ["weight0", "bias0", "weight1", "bias1"]
    assert [n for n, _ in splitgrad.module.GroupedLinear(2, 8, 5, bias=False).named_parameters()] == [
        "weight0",
        "weight1",
    ]
