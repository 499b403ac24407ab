"""The placeholder ``.grad`` a fused layer shows Megatron-style consumers (``splitgrad.core.placeholder``).

Why: Megatron-Core's DDP hook asserts ``param.grad is not None`` under ``overlap_grad_reduce=True`` and skips its
own add when ``grad_added_to_main_grad``; TE satisfies it with a dummy gradient. splitgrad shows one only to
parameters carrying ``grad_added_to_main_grad``, only while the consumers' hooks run (wgrad hooks, or the
AccumulateGrad node's hooks for work done inside backward), and it allocates nothing weight-sized. These tests
pin that lifecycle with a stand-in consumer; tests/integrations/test_megatron.py runs Megatron's own wrapper.
"""

from __future__ import annotations

import pytest
import torch

import splitgrad
from splitgrad.core.placeholder import is_placeholder_grad, placeholder_grad
from splitgrad.testing import AllocationTracker

F64 = torch.float64


def fused_layer(delay: bool, *, consumer: bool = True) -> splitgrad.Linear:
    torch.manual_seed(0)
    layer = splitgrad.Linear(
        48, 64, delay_wgrad_compute=delay, fuse_wgrad_accumulation=True, params_dtype=F64
    )
    for p in layer.parameters():
        p.main_grad = torch.zeros_like(p)
        if consumer:
            p.grad_added_to_main_grad = False
    return layer


def megatron_like_hook(p: torch.nn.Parameter, seen: list) -> object:
    """What Megatron's ``_make_backward_post_hook`` does with ``overlap_grad_reduce=True``."""

    def hook(*_):
        assert p.grad is not None, "param.grad being None is not safe when overlap_grad_reduce is True"
        seen.append((is_placeholder_grad(p.grad), p.grad_added_to_main_grad))
        if not p.grad_added_to_main_grad:
            p.main_grad.add_(p.grad)
        p.grad = None

    return hook


@pytest.mark.parametrize("grouped", [False, True])
def test_wgrad_hook_sees_a_placeholder_in_every_order(grouped):
    """Deferred: shown from the write until after the hooks, for I W I W and I I W W alike."""
    layer = fused_layer(delay=True)
    seen: list = []
    layer.register_wgrad_accumulation_and_reduce_hooks(megatron_like_hook(layer.weight, seen))
    xs = [torch.randn(4, 48, dtype=F64, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    if grouped:
        for x in xs:
            layer(x).sum().backward()
        assert layer.weight.grad is None  # nothing shown before the write
        layer.backward_dw()
        layer.backward_dw()
    else:
        for x in xs:
            layer(x).sum().backward()
            layer.backward_dw()
    assert seen == [(True, True), (True, True)]
    assert layer.weight.grad is None
    x = torch.cat(xs)
    torch.testing.assert_close(
        layer.weight.main_grad, torch.ones(64, 4 * 2, dtype=F64) @ x, rtol=1e-12, atol=1e-12
    )  # two accumulated GEMMs vs one: float64-tight, not bitwise (other arithmetic; issue 23)


def test_accumulate_grad_hook_sees_it_after_the_layers_backward():
    """Immediate fused: a consumer hooking the weight's AccumulateGrad node (Megatron without
    delay_wgrad_compute) reads it after the layer's backward; it is gone once the backward ends."""
    layer = fused_layer(delay=False)
    seen: list = []
    node = torch.autograd.graph.get_gradient_edge(layer.weight).node
    node.register_hook(megatron_like_hook(layer.weight, seen))
    layer(torch.randn(4, 48, dtype=F64)).sum().backward()
    assert seen == [(True, True)] and layer.weight.grad is None
    layer = fused_layer(delay=False)
    read: list = []  # a reader that does not clear it: taken back at the end of the backward anyway
    node = torch.autograd.graph.get_gradient_edge(layer.weight).node
    node.register_hook(lambda *_: read.append(is_placeholder_grad(layer.weight.grad)))
    layer(torch.randn(4, 48, dtype=F64)).sum().backward()
    assert read == [True] and layer.weight.grad is None


def test_only_for_consumers_and_never_over_a_real_gradient():
    """Without ``grad_added_to_main_grad`` nothing is shown; a ``.grad`` a consumer put there stays."""
    layer = fused_layer(delay=True, consumer=False)
    shown: list = []
    layer.register_wgrad_accumulation_and_reduce_hooks(lambda: shown.append(layer.weight.grad))
    layer(torch.randn(4, 48, dtype=F64)).sum().backward()
    layer.backward_dw()
    assert shown == [None] and layer.weight.grad is None
    layer = fused_layer(delay=True)
    real = torch.ones(64, 48, dtype=F64)
    layer.register_wgrad_accumulation_and_reduce_hooks(lambda: setattr(layer.weight, "grad", real))
    layer(torch.randn(4, 48, dtype=F64)).sum().backward()
    layer.backward_dw()
    assert layer.weight.grad is real
    assert layer.bias.grad is not None and not is_placeholder_grad(layer.bias.grad)  # biases go to .grad


def test_placeholder_is_a_zero_view_that_refuses_writes():
    w = torch.nn.Parameter(torch.randn(64, 48, dtype=F64))
    g = placeholder_grad(w)
    assert g.shape == w.shape and g.dtype == w.dtype and g.stride() == (0, 0)
    assert g.untyped_storage().nbytes() == g.element_size()
    main_grad = torch.ones_like(w)
    main_grad.add_(g)  # Megatron's zero_out_wgrad path adds it
    assert torch.equal(main_grad, torch.ones_like(w))
    with pytest.raises(RuntimeError, match="single memory location"):
        g.mul_(2)


def test_no_weight_sized_allocation_per_step():
    """Three fused steps with a Megatron-like consumer allocate nothing as large as the weight; the control
    shows the tracker sees a gradient autograd's AccumulateGrad clones (a cached buffer handed to it
    un-detached, which it cannot steal) — why TE's get_dummy_wgrad returns ``.detach()``, and why splitgrad
    hands autograd nothing."""
    weight_bytes = 64 * 48 * 8
    for delay in (False, True):
        layer = fused_layer(delay=delay)
        seen: list = []
        hook = megatron_like_hook(layer.weight, seen)
        node = torch.autograd.graph.get_gradient_edge(layer.weight).node  # kept alive, as Megatron does
        if delay:
            layer.register_wgrad_accumulation_and_reduce_hooks(hook)
        else:
            node.register_hook(hook)
        x = torch.randn(4, 48, dtype=F64)
        with AllocationTracker() as tracker:
            for _ in range(3):
                layer.weight.grad_added_to_main_grad = False
                layer(x).sum().backward()
                if delay:
                    layer.backward_dw()
        assert len(seen) == 3
        assert tracker.largest_bytes < weight_bytes, tracker.allocations

    cached = torch.zeros(64, 48, dtype=F64)

    class HandsOver(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w, detach):
            ctx.detach = detach
            return x @ w.t()

        @staticmethod
        def backward(ctx, dy):
            return None, cached.detach() if ctx.detach else cached, None

    for detach, cloned in ((False, True), (True, False)):
        w = torch.nn.Parameter(torch.randn(64, 48, dtype=F64))
        with AllocationTracker() as tracker:
            HandsOver.apply(torch.randn(4, 48, dtype=F64), w, detach).sum().backward()
        assert (tracker.largest_bytes >= weight_bytes) is cloned, tracker.allocations
        assert (w.grad.data_ptr() == cached.data_ptr()) is not cloned


def _fused_layers() -> dict[str, tuple[torch.nn.Module, tuple]]:
    """Every kind of layer that fuses into ``main_grad`` (one shared write path, so one convention)."""
    x, xg = torch.randn(4, 8, dtype=F64), torch.randn(5, 8, dtype=F64)
    split = {"delay_wgrad_compute": True}
    return {
        "Linear": (splitgrad.Linear(8, 6, fuse_wgrad_accumulation=True, params_dtype=F64, **split), (x,)),
        "LayerNormMLP": (
            splitgrad.LayerNormMLP(8, 12, fuse_wgrad_accumulation=True, params_dtype=F64, **split),
            (x,),
        ),
        "GroupedLinear": (
            splitgrad.GroupedLinear(2, 8, 6, fuse_wgrad_accumulation=True, params_dtype=F64, **split),
            (xg, [2, 3]),
        ),
        "ops.BasicLinear": (
            splitgrad.ops.BasicLinear(8, 6, accumulate_into_main_grad=True, dtype=F64, **split),
            (x,),
        ),
        "ops.GroupedLinear": (
            splitgrad.ops.GroupedLinear(2, 8, 6, accumulate_into_main_grad=True, dtype=F64, **split),
            (xg, [2, 3]),
        ),
    }


@pytest.mark.parametrize("kind", list(_fused_layers()))
def test_every_fused_layer_shows_its_weights_a_placeholder(kind):
    """Modules and ops, grouped or not: each fused weight shows its hook a placeholder, then none; its
    ``main_grad`` got the gradient and nothing else changed."""
    torch.manual_seed(0)
    layer, args = _fused_layers()[kind]
    weights = [p for p in layer.parameters() if p.dim() == 2]
    for p in weights:
        p.main_grad = torch.zeros_like(p)
        p.grad_added_to_main_grad = False
    seen: list = []
    layer.register_wgrad_accumulation_and_reduce_hooks(
        lambda: seen.append([is_placeholder_grad(p.grad) and p.grad_added_to_main_grad for p in weights])
    )
    out = layer(*args)
    (out[0] if isinstance(out, tuple) else out).square().sum().backward()
    assert all(p.grad is None for p in weights)  # nothing shown before the write
    splitgrad.backward_dw(layer)
    assert seen and all(all(s) for s in seen), seen
    assert all(p.grad is None for p in weights)
    assert all(p.main_grad.abs().sum() > 0 for p in weights)
