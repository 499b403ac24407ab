"""Every split-capable layer family graphs like ``splitgrad.Linear``: modules, ops and a GPT block.

``make_graphed_callables`` finds owners generically (anything with a ``wgrad_store``), so each family built by
the module and ops code must come out bitwise equal to eager — outputs, input and weight gradients,
``main_grad`` — with one hook fire per task per ``backward_dw`` and a complete ``get_backward_dw_params``.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

import splitgrad
from splitgrad import ops
from tests.helpers import make_graphed

from .helpers import (
    assert_same_state,
    changed_params,
    count_hooks,
    eager_step,
    give_main_grad,
    grad_state,
    loss_of,
    seeded,
)


class FixedSplits(nn.Module):
    """A grouped layer with its split sizes fixed: graph inputs are tensors, split sizes are shapes."""

    def __init__(self, grouped: nn.Module, splits: list[int]) -> None:
        super().__init__()
        self.grouped = grouped
        self.splits = splits

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.grouped(x, self.splits)


def _layernorm_linear(fuse: bool) -> nn.Module:
    return splitgrad.LayerNormLinear(6, 5, delay_wgrad_compute=True, fuse_wgrad_accumulation=fuse)


def _layernorm_mlp(fuse: bool) -> nn.Module:
    return splitgrad.LayerNormMLP(6, 12, delay_wgrad_compute=True, fuse_wgrad_accumulation=fuse)


def _grouped(fuse: bool) -> nn.Module:
    layer = splitgrad.GroupedLinear(3, 6, 4, delay_wgrad_compute=True, fuse_wgrad_accumulation=fuse)
    return FixedSplits(layer, [1, 0, 2])


def _ops_sequential(fuse: bool) -> nn.Module:
    return ops.Sequential(
        ops.BasicLinear(6, 8, delay_wgrad_compute=True, accumulate_into_main_grad=fuse),
        ops.Bias(8),
        ops.GELU(),
        ops.Linear(8, 4, delay_wgrad_compute=True, accumulate_into_main_grad=fuse),
    )


def _ops_grouped(fuse: bool) -> nn.Module:
    return FixedSplits(
        ops.Sequential(ops.GroupedLinear(2, 6, 4, delay_wgrad_compute=True, accumulate_into_main_grad=fuse)),
        [2, 1],
    )


FAMILIES: dict[str, Callable[[bool], nn.Module]] = {
    "LayerNormLinear": _layernorm_linear,
    "LayerNormMLP": _layernorm_mlp,
    "GroupedLinear": _grouped,
    "ops.Sequential": _ops_sequential,
    "ops.GroupedLinear": _ops_grouped,
}


@pytest.mark.parametrize("fuse", [False, True], ids=["grad", "main_grad"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_graphed_equals_eager(family: str, fuse: bool) -> None:
    build = FAMILIES[family]
    eager, model = seeded(lambda: build(fuse)), seeded(lambda: build(fuse))
    if fuse:
        give_main_grad(eager)
        give_main_grad(model)
    eager_hooks, graphed_hooks = count_hooks(eager), count_hooks(model)
    graphed = make_graphed(model, (torch.randn(3, 6, requires_grad=True),), num_warmup_iters=2)
    expected_dw = [p for _, m in splitgrad.split_modules(model) for p in m.get_backward_dw_params()]
    assert [id(p) for p in graphed.get_backward_dw_params()] == [id(p) for p in expected_dw]
    torch.manual_seed(5)
    dw_names = {n for n, p in model.named_parameters() if any(p is q for q in expected_dw)}
    for step in range(2):
        x = torch.randn(3, 6)
        xe, xg = x.clone().requires_grad_(), x.clone().requires_grad_()
        yg = graphed(xg)
        loss_of(yg).backward()
        before = grad_state(model)
        graphed.backward_dw()
        if step == 0:  # from None, every write shows (a zero-row group's gradient is zero, not absent)
            assert changed_params(before, grad_state(model)) == dw_names
        torch.testing.assert_close(yg, eager_step(eager, xe), rtol=0, atol=0)
        torch.testing.assert_close(xg.grad, xe.grad, rtol=0, atol=0)
        assert_same_state(grad_state(model), grad_state(eager))
        assert graphed_hooks == eager_hooks and all(n > 0 for n in graphed_hooks.values())


def _gpt_blocks(delay: bool) -> nn.ModuleList:
    from splitgrad.models import GPT, GPTConfig

    config = GPTConfig(vocab_size=11, seq_len=4, hidden_size=16, num_heads=2, num_layers=2)
    config.delay_wgrad_compute = delay
    return GPT(config).blocks


def test_gpt_block_stack_graphed_per_layer() -> None:
    """Two GPT blocks graphed as two callables (TE's per-layer usage), stepped like a training loop."""
    eager, model = seeded(lambda: _gpt_blocks(True)), seeded(lambda: _gpt_blocks(True))
    counts_e, counts_g = count_hooks(eager), count_hooks(model)
    samples = tuple((torch.randn(2, 4, 16, requires_grad=True),) for _ in model)
    graphed = make_graphed(tuple(model), samples, num_warmup_iters=1)
    for _ in range(2):
        x = torch.randn(2, 4, 16)
        xe, xg = x.clone().requires_grad_(), x.clone().requires_grad_()
        ye, yg = xe, xg
        for block in eager:
            ye = block(ye)
        for g in graphed:
            yg = g(yg)
        torch.testing.assert_close(yg, ye, rtol=0, atol=0)
        ye.square().sum().backward()
        yg.square().sum().backward()
        for block in eager:
            splitgrad.backward_dw(block)
        for g in reversed(graphed):
            g.backward_dw()
        torch.testing.assert_close(xg.grad, xe.grad, rtol=0, atol=0)
        for e, m in zip(eager, model):
            assert_same_state(grad_state(m), grad_state(e))
        assert counts_g == counts_e
