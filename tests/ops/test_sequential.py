"""``ops.Sequential``: a drop-in ``nn.Sequential``, and an ops MLP equal to the ``LayerNormMLP`` module.

Why: users swap ``nn.Sequential``/``nn.Linear`` for the ops versions and expect the same indexing,
state_dict keys and numbers; and the ops MLP and the fused module are two routes to one function, so their
outputs and every gradient (delayed or not) must agree.
"""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from torch import nn

import splitgrad
from splitgrad import ops
from splitgrad.module.layernorm_mlp import LayerNormMLP
from tests.helpers import grads
from tests.ops._reference import assert_results_close, run_module

D = torch.float64


def _mlp(**kw) -> ops.Sequential:
    return ops.Sequential(
        ops.LayerNorm(6, dtype=D),
        ops.Linear(6, 10, dtype=D, **kw),
        ops.GELU(),
        ops.Linear(10, 6, dtype=D, **kw),
    )


def test_drop_in_nn_sequential() -> None:
    torch.manual_seed(0)
    seq = _mlp()
    plain = nn.Sequential(
        nn.LayerNorm(6, dtype=D), nn.Linear(6, 10, dtype=D), nn.GELU("tanh"), nn.Linear(10, 6, dtype=D)
    )
    assert list(seq.state_dict()) == list(plain.state_dict())
    with torch.no_grad():
        seq[0].weight.normal_()
        seq[0].bias.normal_()
    plain.load_state_dict(seq.state_dict())
    assert len(seq) == 4 and isinstance(seq[1], ops.Linear) and isinstance(seq[-1], ops.Linear)
    gen = torch.Generator().manual_seed(3)
    x, dy = torch.randn(2, 5, 6, generator=gen, dtype=D), torch.randn(2, 5, 6, generator=gen, dtype=D)
    got, want = run_module(seq, x, dy), run_module(plain, x, dy)
    want = (want[0], want[1], want[2])
    assert_results_close(got, want, rtol=1e-13, atol=1e-14)

    head = seq[:2]
    assert isinstance(head, ops.Sequential) and len(head) == 2 and head.fusions is seq.fusions
    torch.testing.assert_close(head(x), plain[:2](x), rtol=1e-13, atol=1e-14)
    named = ops.Sequential(OrderedDict(norm=ops.LayerNorm(6), act=ops.ReLU()))
    assert list(named.state_dict()) == ["norm.weight", "norm.bias"]


def test_structure_changes_regroup_and_non_ops_pass_through() -> None:
    torch.manual_seed(0)
    seq = ops.Sequential(ops.Linear(4, 4), ops.ReLU())
    assert len(seq.fusers) == 1
    seq.append(nn.Tanh())
    seq.append(ops.Linear(4, 3))
    assert len(seq.fusers) == 2
    x = torch.randn(5, 4)
    ref = seq[3](torch.tanh(torch.relu(seq[0](x))))
    torch.testing.assert_close(seq(x), ref, rtol=0, atol=0)
    del seq[2]
    torch.testing.assert_close(seq(x), seq[2](torch.relu(seq[0](x))), rtol=0, atol=0)
    assert len(seq.fusers) == 1

    with pytest.raises(ValueError, match="take 0 extra input"):
        seq(x, [5])


def test_linear_relinks_replaced_parameters() -> None:
    """load_state_dict(assign=True) replaces Parameter objects; the inner ops must use the new ones."""
    torch.manual_seed(0)
    lin = ops.Linear(4, 3, delay_wgrad_compute=True)
    new = {"weight": torch.randn(3, 4), "bias": torch.randn(3)}
    lin.load_state_dict(new, assign=True)
    x = torch.randn(2, 4)
    torch.testing.assert_close(lin(x), x @ new["weight"].t() + new["bias"], rtol=1e-6, atol=1e-6)
    assert lin.weight.skip_backward_post_hook
    assert lin.get_backward_dw_params() == [lin.weight]


def test_splitgrad_modules_inside_are_part_of_the_contract() -> None:
    """A splitgrad module passed through a Sequential is drained by its backward_dw like the ops."""
    torch.manual_seed(0)
    seq = ops.Sequential(
        ops.Linear(4, 4, delay_wgrad_compute=True), splitgrad.Linear(4, 3, delay_wgrad_compute=True)
    )
    seq(torch.randn(2, 4)).sum().backward()
    assert splitgrad.pending_wgrad(seq) == 2
    assert len(seq.get_backward_dw_params()) == 3  # ops.Linear defers its weight; the module weight and bias
    seq.backward_dw()
    assert all(p.grad is not None for p in seq.parameters())


ACTS = {"gelu": ops.GELU, "relu": ops.ReLU, "swiglu": ops.SwiGLU, "geglu": ops.GEGLU}


def _ops_mlp_like(module: LayerNormMLP, norm: str, act: str, **kw) -> ops.Sequential:
    """An ops MLP holding ``module``'s parameter values."""
    hidden, ffn = module.hidden_size, module.ffn_hidden_size
    fc1_out = module.fc1_weight.shape[0]
    norm_op = (
        ops.LayerNorm(hidden, eps=module.eps, dtype=D)
        if norm == "LayerNorm"
        else ops.RMSNorm(hidden, eps=module.eps, dtype=D)
    )
    seq = ops.Sequential(
        norm_op,
        ops.Linear(hidden, fc1_out, dtype=D, **kw),
        ACTS[act](),
        ops.Linear(ffn, hidden, dtype=D, **kw),
    )
    with torch.no_grad():
        seq[0].weight.copy_(module.layer_norm_weight)
        if norm == "LayerNorm":
            seq[0].bias.copy_(module.layer_norm_bias)
        for i, fc in ((1, "fc1"), (3, "fc2")):
            seq[i].weight.copy_(getattr(module, f"{fc}_weight"))
            seq[i].bias.copy_(getattr(module, f"{fc}_bias"))
    return seq


@pytest.mark.parametrize("delay", [False, True])
@pytest.mark.parametrize(
    ("norm", "act"),
    [("LayerNorm", "gelu"), ("LayerNorm", "relu"), ("RMSNorm", "swiglu"), ("LayerNorm", "geglu")],
)
def test_ops_mlp_matches_layernorm_mlp_module(norm: str, act: str, delay: bool) -> None:
    torch.manual_seed(0)
    module = LayerNormMLP(
        6, 8, eps=1e-3, normalization=norm, activation=act, delay_wgrad_compute=delay, params_dtype=D
    )
    with torch.no_grad():  # non-trivial norm parameters
        module.layer_norm_weight.normal_()
        if module.layer_norm_bias is not None:
            module.layer_norm_bias.normal_()
    seq = _ops_mlp_like(module, norm, act, delay_wgrad_compute=delay)
    gen = torch.Generator().manual_seed(4)
    for _ in range(2):  # two backwards: both accumulate
        x = torch.randn(3, 5, 6, generator=gen, dtype=D)
        dy = torch.randn(3, 5, 6, generator=gen, dtype=D)
        (y, dx, _), (ry, rdx, _) = run_module(seq, x, dy), run_module(module, x, dy)
        torch.testing.assert_close(y, ry, rtol=1e-12, atol=1e-13)
        torch.testing.assert_close(dx, rdx, rtol=1e-12, atol=1e-13)
    if delay:
        assert splitgrad.pending_wgrad(seq) == 4 and splitgrad.pending_wgrad(module) == 2
        assert seq.fusers[0].backward_ops and all(p.grad is None for p in seq.get_backward_dw_params())
        splitgrad.backward_dw(seq)
        splitgrad.backward_dw(module)
    g, rg = grads(seq), grads(module)
    names = {
        "0.weight": "layer_norm_weight",
        "0.bias": "layer_norm_bias",
        "1.weight": "fc1_weight",
        "1.bias": "fc1_bias",
        "3.weight": "fc2_weight",
        "3.bias": "fc2_bias",
    }
    assert len(g) == len(rg)
    for ours, theirs in names.items():
        if ours in g:
            torch.testing.assert_close(
                g[ours], rg[theirs], rtol=1e-12, atol=1e-13, msg=lambda m, o=ours: f"{o}: {m}"
            )


def test_mlp_comparison_rejects_a_mismatch() -> None:
    """Not trivially passing: a different activation (tanh GELU vs ReLU) is caught by the same comparison."""
    torch.manual_seed(0)
    module = LayerNormMLP(6, 8, activation="gelu", params_dtype=D)
    seq = _ops_mlp_like(module, "LayerNorm", "gelu")
    seq[2] = ops.ReLU()
    x = torch.randn(4, 6, dtype=D)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(seq(x), module(x), rtol=1e-12, atol=1e-13)
