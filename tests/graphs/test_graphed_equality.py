"""Graphed layers must train exactly like eager ones, on the CPU stand-in.

The stand-in replays the very aten calls eager mode runs, so outputs and every gradient (``.grad``,
``main_grad``, ``grad_added_to_main_grad``) are compared bitwise over several steps; a float64 run is compared
with plain ``torch.nn`` autograd. Hooks must fire exactly as often as eagerly — after the wgrad replay, never
inside a graph — and ``get_backward_dw_params`` must list exactly what ``backward_dw`` writes.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import splitgrad
from tests.helpers import make_graphed

from .helpers import (
    assert_same_state,
    changed_params,
    count_hooks,
    eager_step,
    give_main_grad,
    grad_state,
    graphed_step,
    loss_of,
    mlp,
    seeded,
)

MODES = [
    pytest.param(True, False, id="delay"),
    pytest.param(True, True, id="delay+fuse"),
    pytest.param(False, True, id="fuse"),
    pytest.param(False, False, id="immediate"),
]


def _twins(delay: bool, fuse: bool):
    eager = seeded(lambda: mlp(delay=delay, fuse=fuse))
    model = seeded(lambda: mlp(delay=delay, fuse=fuse))
    if fuse:
        give_main_grad(eager)
        give_main_grad(model)
    return eager, model


@pytest.mark.parametrize(("delay", "fuse"), MODES)
def test_graphed_matches_eager_bitwise(delay: bool, fuse: bool) -> None:
    eager, model = _twins(delay, fuse)
    eager_hooks, graphed_hooks = count_hooks(eager), count_hooks(model)
    graphed = make_graphed(model, (torch.randn(3, 6, requires_grad=True),))
    assert graphed.need_backward_dw() is delay
    assert all(n == 0 for n in graphed_hooks.values()), "capture must not fire hooks"
    assert_same_state(grad_state(model), grad_state(eager))  # capture left the gradients untouched

    torch.manual_seed(1)
    for step in range(4):
        if step == 2:  # optimizer.zero_grad(set_to_none=True) between steps
            for m in (eager, model):
                m.zero_grad(set_to_none=True)
        x = torch.randn(3, 6)
        xe, xg = x.clone().requires_grad_(), x.clone().requires_grad_()
        ye = eager_step(eager, xe)
        yg = graphed_step(graphed, xg)
        torch.testing.assert_close(yg, ye, rtol=0, atol=0)
        torch.testing.assert_close(xg.grad, xe.grad, rtol=0, atol=0)
        assert_same_state(grad_state(model), grad_state(eager))
        assert graphed_hooks == eager_hooks


def test_hooks_fire_once_per_backward_dw_not_in_backward() -> None:
    model = seeded(mlp)
    counts = count_hooks(model)
    graphed = make_graphed(model, (torch.randn(3, 6),))
    for replay in range(1, 6):
        loss_of(graphed(torch.randn(3, 6))).backward()
        assert counts == {"0": replay - 1, "2": replay - 1}, "hooks must wait for backward_dw"
        graphed.backward_dw()
        assert counts == {"0": replay, "2": replay}


def test_fused_immediate_hooks_fire_after_backward_replay() -> None:
    model = seeded(lambda: mlp(delay=False, fuse=True))
    give_main_grad(model)
    counts = count_hooks(model)
    graphed = make_graphed(model, (torch.randn(3, 6),))
    for replay in range(1, 4):
        loss_of(graphed(torch.randn(3, 6))).backward()
        assert counts == {"0": replay, "2": replay}
        assert model[0].weight.grad_added_to_main_grad is True
        model[0].weight.grad_added_to_main_grad = False  # what Megatron's DDP does after reducing


def test_hook_registered_after_capture_fires_removed_one_does_not() -> None:
    model = seeded(mlp)
    early = count_hooks(model)
    graphed = make_graphed(model, (torch.randn(3, 6),))
    late: list[str] = []
    model[2].register_wgrad_accumulation_and_reduce_hooks(lambda: late.append("late"))
    model[0].register_wgrad_accumulation_and_reduce_hooks(lambda: late.append("removed")).remove()
    graphed_step(graphed, torch.randn(3, 6))
    assert late == ["late"]
    assert early == {"0": 1, "2": 1}


def test_hook_order_matches_eager_backward_dw() -> None:
    eager, model = _twins(True, False)
    order_e: list[str] = []
    order_g: list[str] = []
    for m, log in ((eager, order_e), (model, order_g)):
        for name, module in splitgrad.split_modules(m):
            module.register_wgrad_accumulation_and_reduce_hooks(lambda name=name, log=log: log.append(name))
    graphed = make_graphed(model, (torch.randn(3, 6),))
    eager_step(eager, torch.randn(3, 6))
    graphed_step(graphed, torch.randn(3, 6))
    assert order_g == order_e == ["2", "0"]


@pytest.mark.parametrize(("delay", "fuse"), MODES[:2])
def test_get_backward_dw_params_is_exactly_what_backward_dw_writes(delay: bool, fuse: bool) -> None:
    model = seeded(lambda: mlp(delay=delay, fuse=fuse))
    if fuse:
        give_main_grad(model)
    model[2].bias.requires_grad_(False)  # frozen: neither listed nor written
    graphed = make_graphed(model, (torch.randn(3, 6),))
    listed = graphed.get_backward_dw_params()
    expected = [model[0].weight, model[0].bias, model[2].weight]
    assert [id(p) for p in listed] == [id(p) for p in expected]

    loss_of(graphed(torch.randn(3, 6))).backward()
    before = grad_state(model)
    graphed.backward_dw()
    names = {n for n, p in model.named_parameters() if any(p is q for q in listed)}
    assert changed_params(before, grad_state(model)) == names


def test_replay_many_times_without_drift() -> None:
    model = seeded(mlp)
    graphed = make_graphed(model, (torch.randn(3, 6, requires_grad=True),))
    x = torch.randn(3, 6, requires_grad=True)
    first = None
    out_ptrs = {o.data_ptr() for o in graphed.static_outputs}
    for _ in range(25):
        model.zero_grad(set_to_none=False)
        x.grad = None
        y = graphed_step(graphed, x)
        snap = (y, x.grad.clone(), grad_state(model))
        if first is None:
            first = snap
            buffers = [p.grad for p in model.parameters()]
        torch.testing.assert_close(snap[0], first[0], rtol=0, atol=0)
        torch.testing.assert_close(snap[1], first[1], rtol=0, atol=0)
        assert_same_state(snap[2], first[2])
        assert all(p.grad is b for p, b in zip(model.parameters(), buffers)), "gradient buffers must not move"
        assert {o.data_ptr() for o in graphed.static_outputs} == out_ptrs
    assert graphed.graphs["wgrad"].replays == 25


def test_float64_against_plain_autograd() -> None:
    """The graphed float64 gradients agree with ``torch.nn`` autograd on the same weights (tight tolerance)."""
    model = seeded(lambda: mlp(dtype=torch.float64))
    reference = nn.Sequential(
        nn.Linear(6, 10, dtype=torch.float64),
        nn.GELU(),
        nn.Linear(10, 5, dtype=torch.float64),
        nn.Linear(5, 4, dtype=torch.float64),
    )
    reference.load_state_dict(model.state_dict())
    graphed = make_graphed(model, (torch.randn(3, 6, dtype=torch.float64, requires_grad=True),))
    for _ in range(2):
        x = torch.randn(3, 6, dtype=torch.float64)
        xg, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
        yg = graphed_step(graphed, xg)
        yr = reference(xr)
        loss_of(yr).backward()
        torch.testing.assert_close(yg, yr.detach(), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(xg.grad, xr.grad, rtol=1e-12, atol=1e-12)
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-12, msg=name)


def test_returned_gradients_are_not_aliased_by_autograd() -> None:
    """Autograd steals a returned gradient whose tensor nobody else holds (``param.grad`` would then alias
    the static buffer and the next replay would double it); two accumulating backwards catch that."""
    eager = seeded(lambda: mlp(delay=False))
    model = seeded(lambda: mlp(delay=False))
    graphed = make_graphed(model, (torch.randn(3, 6),))
    for _ in range(2):
        x = torch.randn(3, 6)
        eager_step(eager, x)
        graphed_step(graphed, x)
    assert_same_state(grad_state(model), grad_state(eager))
    assert model[3].weight.grad.data_ptr() != graphed._captured.grad_returns[-2].data_ptr()


def test_python_side_effects_do_not_replay() -> None:
    """The stand-in runs no Python on replay, like a CUDA graph: a counter in forward stops counting and a
    Python float read in forward stays baked in (a bug in eager-only code paths would show up here)."""

    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = splitgrad.Linear(4, 4, delay_wgrad_compute=True)
            self.calls = 0
            self.scale = 2.0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.calls += 1
            return self.lin(x) * self.scale

    module = Scaled()
    graphed = make_graphed(module, (torch.randn(2, 4),), num_warmup_iters=2)
    calls = module.calls
    assert calls == 3  # two warm-up iterations and the capture
    module.scale = 5.0
    x = torch.randn(2, 4)
    y = graphed(x)
    assert module.calls == calls
    torch.testing.assert_close(y, module.lin(x) * 2.0, rtol=0, atol=0)


def test_raw_wgrad_replay_writes_gradients_but_fires_no_hook() -> None:
    """Negative check of the harness: replaying the wgrad graph without ``backward_dw`` updates the gradient
    and fires nothing — exactly the bug (hooks missing after replay) the equality tests would catch."""
    model = seeded(mlp)
    counts = count_hooks(model)
    graphed = make_graphed(model, (torch.randn(3, 6),))
    graphed_step(graphed, torch.randn(3, 6))
    before = model[0].weight.grad.clone()
    loss_of(graphed(torch.randn(3, 6))).backward()
    graphed.graphs["wgrad"].replay()
    assert not torch.equal(model[0].weight.grad, before)
    assert counts == {"0": 1, "2": 1}
    graphed._pending_dw = False  # leave the object consistent for its __del__ check


def test_comparison_rejects_a_wrong_gradient() -> None:
    """Negative check: one missing backward_dw makes the bitwise comparison fail."""
    eager, model = _twins(True, False)
    graphed = make_graphed(model, (torch.randn(3, 6),))
    x = torch.randn(3, 6)
    eager_step(eager, x)
    eager_step(eager, x)
    graphed_step(graphed, x)
    loss_of(graphed(x)).backward()  # second step without its wgrad
    with pytest.raises(AssertionError):
        assert_same_state(grad_state(model), grad_state(eager))
    graphed.backward_dw()
    assert_same_state(grad_state(model), grad_state(eager))


def test_several_callables_chain_like_a_layer_stack() -> None:
    eager = [seeded(lambda: mlp(), seed=s) for s in (0, 1)]
    layers = [seeded(lambda: mlp(), seed=s) for s in (0, 1)]
    for m in (eager[1], layers[1]):
        m[0] = splitgrad.Linear(4, 10, delay_wgrad_compute=True)
    torch.manual_seed(3)
    eager[1][0].load_state_dict(layers[1][0].state_dict())
    g0, g1 = make_graphed(
        tuple(layers), ((torch.randn(3, 6, requires_grad=True),), (torch.randn(3, 4, requires_grad=True),))
    )
    for _ in range(2):
        x = torch.randn(3, 6)
        loss_of(eager[1](eager[0](x))).backward()
        for m in eager:
            splitgrad.backward_dw(m)
        loss_of(g1(g0(x))).backward()
        g1.backward_dw()
        g0.backward_dw()
        for e, m in zip(eager, layers):
            assert_same_state(grad_state(m), grad_state(e))
