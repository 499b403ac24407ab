"""The deferred-wgrad contract of splitgrad.Linear: hooks, main_grad, flags, params, and the switch.

Why: data-parallel wrappers and CUDA-graph callers rely on exactly when hooks fire, which parameters are
written, and which attributes say so (Megatron reads ``skip_backward_post_hook``).
"""

from __future__ import annotations

import pytest
import torch

import splitgrad
from tests.helpers import attach_main_grad


def _backward(layer: splitgrad.Linear, seed: int = 0) -> None:
    x = torch.randn(4, layer.in_features, generator=torch.Generator().manual_seed(seed), requires_grad=True)
    layer(x).square().sum().backward()


def test_hooks_fire_once_per_backward_dw_after_grads_written():
    layer = splitgrad.Linear(3, 2, delay_wgrad_compute=True)
    seen = []
    handle = layer.register_wgrad_accumulation_and_reduce_hooks(
        lambda: seen.append((layer.weight.grad.clone(), layer.bias.grad.clone()))
    )
    _backward(layer, 0)
    _backward(layer, 1)
    assert seen == []  # never at backward time when delaying
    layer.backward_dw()
    assert len(seen) == 1
    torch.testing.assert_close(seen[0][0], layer.weight.grad)  # grads were already written when it fired
    layer.backward_dw()
    assert len(seen) == 2
    handle.remove()
    _backward(layer, 2)
    layer.backward_dw()
    assert len(seen) == 2


def test_two_hooks_fire_in_registration_order_and_remove_independently():
    layer = splitgrad.Linear(3, 2, delay_wgrad_compute=True)
    order = []
    h1 = layer.register_wgrad_accumulation_and_reduce_hooks(lambda: order.append(1))
    layer.register_wgrad_accumulation_and_reduce_hooks(lambda: order.append(2))
    _backward(layer)
    layer.backward_dw()
    h1.remove()
    h1.remove()  # idempotent, like torch's handles
    _backward(layer)
    layer.backward_dw()
    assert order == [1, 2, 2]


@pytest.mark.parametrize("bias", [True, False])
def test_main_grad_untouched_by_backward_and_accumulated_by_backward_dw(bias):
    torch.manual_seed(0)
    layer = splitgrad.Linear(5, 3, bias=bias, delay_wgrad_compute=True, fuse_wgrad_accumulation=True)
    ref = torch.nn.Linear(5, 3, bias=bias)
    ref.load_state_dict(layer.state_dict())
    attach_main_grad(layer, seed=1, dtype=torch.float32)
    start = layer.weight.main_grad.clone()
    layer.weight.grad_added_to_main_grad = False
    x = torch.randn(4, 5)
    layer(x).sum().backward()
    ref(x).sum().backward()
    torch.testing.assert_close(layer.weight.main_grad, start, rtol=0, atol=0)
    assert layer.weight.grad_added_to_main_grad is False
    buffer = layer.weight.main_grad
    layer.backward_dw()
    assert layer.weight.main_grad is buffer  # written in place, the DDP view stays valid
    torch.testing.assert_close(layer.weight.main_grad, start + ref.weight.grad)
    assert layer.weight.grad is None
    assert layer.weight.grad_added_to_main_grad is True
    if bias:
        torch.testing.assert_close(layer.bias.grad, ref.bias.grad)


def test_overwrite_main_grad_and_bf16_operands():
    torch.manual_seed(1)
    layer = splitgrad.Linear(
        5, 3, delay_wgrad_compute=True, fuse_wgrad_accumulation=True, params_dtype=torch.bfloat16
    )
    attach_main_grad(
        layer, fill=float("nan"), dtype=torch.float32
    )  # overwrite must not propagate the old contents (beta=0)
    layer.weight.overwrite_main_grad = True
    x = torch.randn(4, 5, dtype=torch.bfloat16)
    dy = torch.randn(4, 3, dtype=torch.bfloat16)
    layer(x).backward(dy)
    layer.backward_dw()
    expected = dy.float().t() @ x.float()
    assert layer.weight.main_grad.dtype == torch.float32
    torch.testing.assert_close(layer.weight.main_grad, expected, rtol=1e-6, atol=1e-6)


def test_fused_accumulates_across_microbatches_like_autograd():
    torch.manual_seed(2)
    layer = splitgrad.Linear(
        5, 3, delay_wgrad_compute=True, fuse_wgrad_accumulation=True, params_dtype=torch.float64
    )
    ref = torch.nn.Linear(5, 3, dtype=torch.float64)
    ref.load_state_dict(layer.state_dict())
    for p in layer.parameters():
        p.main_grad = torch.zeros_like(p)
    for _ in range(3):
        x = torch.randn(4, 5, dtype=torch.float64)
        layer(x).sin().sum().backward()
        ref(x).sin().sum().backward()
    splitgrad.backward_dw(layer)
    torch.testing.assert_close(layer.weight.main_grad, ref.weight.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(layer.bias.grad, ref.bias.grad, rtol=1e-12, atol=1e-12)


def test_get_backward_dw_params_and_skip_flags():
    layer = splitgrad.Linear(3, 2, delay_wgrad_compute=True)
    assert layer.get_backward_dw_params() == [layer.weight, layer.bias]
    assert layer.need_backward_dw()
    assert all(p.skip_backward_post_hook for p in layer.parameters())
    nobias = splitgrad.Linear(3, 2, bias=False, delay_wgrad_compute=True)
    assert nobias.get_backward_dw_params() == [nobias.weight]
    plain = splitgrad.Linear(3, 2)
    assert not plain.need_backward_dw()
    assert not any(p.skip_backward_post_hook for p in plain.parameters())
    fused = splitgrad.Linear(3, 2, fuse_wgrad_accumulation=True)
    # The module writes these itself (main_grad / bias.grad) and announces them via the wgrad hooks.
    assert all(p.skip_backward_post_hook for p in fused.parameters())


def test_whole_model_switch_keeps_flags_consistent():
    model = torch.nn.Sequential(
        splitgrad.Linear(3, 4), torch.nn.ReLU(), splitgrad.Linear(4, 2), torch.nn.Linear(2, 2)
    )
    assert splitgrad.set_delay_wgrad_compute(model, True) == 2
    assert model[0].need_backward_dw() and model[2].need_backward_dw()
    assert model[0].weight.skip_backward_post_hook and model[2].bias.skip_backward_post_hook
    assert not hasattr(model[3].weight, "skip_backward_post_hook")
    model(torch.randn(2, 3)).sum().backward()
    assert splitgrad.pending_wgrad(model) == 2
    # Switching off leaves pending work pending (never dropped) and still drainable.
    splitgrad.set_delay_wgrad_compute(model, False)
    assert not model[0].weight.skip_backward_post_hook
    assert splitgrad.pending_wgrad(model) == 2
    assert splitgrad.backward_dw(model) == 2
    model(torch.randn(2, 3)).sum().backward()
    assert splitgrad.pending_wgrad(model) == 0


def test_fused_wgrad_allocates_nothing_weight_sized():
    """The fused path computes straight into main_grad: its largest allocation is far below the weight."""
    from splitgrad.testing.memory import AllocationTracker

    for fused in (True, False):
        layer = splitgrad.Linear(64, 256, delay_wgrad_compute=True, fuse_wgrad_accumulation=fused)
        attach_main_grad(layer, fill=0.0)
        layer(torch.randn(8, 64)).sum().backward()
        weight_bytes = layer.weight.numel() * layer.weight.element_size()
        with AllocationTracker() as tracker:
            layer.backward_dw()
        if fused:
            assert tracker.largest_bytes < weight_bytes, tracker.allocations
        else:  # negative check: the unfused path does allocate the weight gradient, and the tracker sees it
            assert tracker.largest_bytes >= weight_bytes, tracker.allocations
