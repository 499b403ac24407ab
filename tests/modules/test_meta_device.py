"""Every splitgrad module builds and runs on the ``meta`` device and materialises into a correct layer.

Why: deferred initialisation (``device="meta"``, then ``to_empty`` + ``reset_parameters``) is how FSDP2 and
torchtitan build big models. Forward on meta must give the right shapes without touching autocast state, and
the materialised layer must train exactly like one built on the CPU — including the
``skip_backward_post_hook`` flags, which ``to_empty`` would otherwise drop with the old Parameter objects
(a data-parallel wrapper would then count the module-written gradients twice).
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

import splitgrad
from splitgrad import ops
from tests.modules import harness as h
from tests.modules import test_grouped_linear, test_layernorm_linear, test_layernorm_mlp

LINEAR = h.Case(
    name="linear",
    make=functools.partial(splitgrad.Linear, 8, 5),
    x_shape=(6, 8),
    call=lambda module, x: (module(x),),
    reference=lambda p, x: (F.linear(x, p["weight"], p["bias"]),),
)
CASES = [LINEAR, test_layernorm_linear.CASES[0], test_layernorm_mlp.CASES[0], test_grouped_linear.CASES[0]]


def _materialised(case: h.Case, mode: str, *, seed: int) -> torch.nn.Module:
    module = case.make(**h.mode_kwargs(mode), params_dtype=torch.float64, device="meta")
    module.to_empty(device="cpu")
    torch.manual_seed(seed)
    module.reset_parameters()
    return module


@pytest.mark.parametrize("case", CASES, ids=str)
def test_meta_forward_gives_the_cpu_shapes(case):
    meta = case.make(delay_wgrad_compute=True, params_dtype=torch.float64, device="meta")
    cpu = case.make(delay_wgrad_compute=True, params_dtype=torch.float64)
    assert all(p.is_meta for p in meta.parameters())
    x = torch.zeros(case.x_shape, dtype=torch.float64)
    outs = case.call(meta, x.to("meta"))
    want = case.call(cpu, x)
    assert [o.shape for o in outs] == [o.shape for o in want]
    assert all(o.is_meta for o in outs)


@pytest.mark.parametrize("mode", ["immediate", "delayed", "fused_delayed"])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_to_empty_and_reset_parameters_give_the_cpu_layer(case, mode):
    module = _materialised(case, mode, seed=3)
    torch.manual_seed(3)
    cpu = case.make(**h.mode_kwargs(mode), params_dtype=torch.float64)
    for (name, p), (cname, q) in zip(module.named_parameters(), cpu.named_parameters()):
        assert name == cname and p.device.type == "cpu"
        torch.testing.assert_close(p, q, **h.EXACT)  # the same init, not just "some" numbers
        assert getattr(p, "skip_backward_post_hook", None) == getattr(q, "skip_backward_post_hook", None), (
            name
        )
    assert module.get_backward_dw_params() == [p for p in module.wgrad_parameters() if p.requires_grad]

    # Trains like plain autograd (float64) and bitwise like the CPU-built layer in immediate mode.
    got = h.run(case, mode, torch.float64, steps=2, module=module)
    torch.manual_seed(3)
    immediate = case.make(params_dtype=torch.float64)
    if mode.startswith("fused"):
        h.attach_main_grad(immediate, seed=1)
        ref_module = immediate
        want = h.reference(case, torch.float64, steps=2, module=ref_module)
        for name, p in ref_module.named_parameters():
            if hasattr(p, "main_grad"):
                want[2][name] = want[2][name] + p.main_grad
    else:
        want = h.reference(case, torch.float64, steps=2, module=immediate)
        h.assert_all_close(got, h.run(case, "immediate", torch.float64, steps=2, module=immediate), h.EXACT)
    h.assert_all_close(got, want, h.F64)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_a_differently_initialised_layer_is_rejected(case):
    """Not trivially passing: a materialised layer with another seed must fail the comparison."""
    module = _materialised(case, "delayed", seed=4)
    torch.manual_seed(3)
    want = h.reference(case, torch.float64, steps=1, module=case.make(params_dtype=torch.float64))
    with pytest.raises(AssertionError):
        h.assert_all_close(h.run(case, "delayed", torch.float64, module=module), want, h.F64)


def test_ops_grouped_linear_on_meta_and_materialised():
    meta = ops.GroupedLinear(3, 8, 5, delay_wgrad_compute=True, dtype=torch.float64, device="meta")
    assert meta(torch.empty(2, 5, 8, device="meta", dtype=torch.float64), [4, 0, 6]).shape == (2, 5, 5)
    meta.to_empty(device="cpu")
    torch.manual_seed(5)
    meta.reset_parameters()
    torch.manual_seed(5)
    cpu = ops.GroupedLinear(3, 8, 5, dtype=torch.float64)
    assert all(p.skip_backward_post_hook for p in meta.parameters())
    splits = [4, 0, 6]
    x = torch.randn(10, 8, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(10, 5, dtype=torch.float64)
    meta(x, splits).backward(dy)
    dx_meta = x.grad
    x.grad = None
    assert splitgrad.pending_wgrad(meta) == 1
    meta.backward_dw()
    cpu(x, splits).backward(dy)
    torch.testing.assert_close(dx_meta, x.grad, **h.EXACT)
    params = {n: p.detach().clone().requires_grad_() for n, p in cpu.named_parameters()}
    xs = x.detach().split(splits)
    ref = torch.cat([F.linear(xi, params[f"weight{g}"], params[f"bias{g}"]) for g, xi in enumerate(xs)])
    ref.backward(dy)
    for (name, p), q in zip(meta.named_parameters(), cpu.parameters()):
        torch.testing.assert_close(p.grad, q.grad, **h.EXACT)
        torch.testing.assert_close(p.grad, params[name].grad, **h.F64)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(meta.weight0.grad, params["weight2"].grad, **h.F64)
