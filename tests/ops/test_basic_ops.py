"""Every basic op (and the composite ``ops.Linear``) against float64 plain PyTorch: output and every gradient.

Why: ops return their gradients to a fuser instead of autograd; a wrong or misaligned ``param_grads`` entry
would silently train the wrong parameter. Each op is checked standalone, inside an unfused ``Sequential``, with
2-D and 3-D inputs, and with frozen inputs/parameters (which skip work in backward).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from splitgrad import ops
from tests.ops._reference import (
    assert_results_close,
    gelu_tanh,
    grouped_ref,
    layer_norm,
    linear_ref,
    rms_norm,
    run_module,
    run_reference,
    silu,
)

D = torch.float64

# name -> (make op, reference fn(x, params), input features, output features)
CASES = {
    "BasicLinear": (lambda: ops.BasicLinear(6, 5, dtype=D), lambda x, p: x @ p["weight"].t(), 6, 5),
    "Bias": (lambda: _randomized(ops.Bias(6, dtype=D)), lambda x, p: x + p["bias"], 6, 6),
    "Linear": (lambda: ops.Linear(6, 5, dtype=D), lambda x, p: linear_ref(x, p["weight"], p["bias"]), 6, 5),
    "Linear-nobias": (
        lambda: ops.Linear(6, 5, bias=False, dtype=D),
        lambda x, p: linear_ref(x, p["weight"], None),
        6,
        5,
    ),
    "LayerNorm": (
        lambda: _randomized(ops.LayerNorm(6, eps=1e-3, dtype=D)),
        lambda x, p: layer_norm(x, p["weight"], p["bias"], 1e-3),
        6,
        6,
    ),
    "RMSNorm": (
        lambda: _randomized(ops.RMSNorm(6, eps=1e-3, dtype=D)),
        lambda x, p: rms_norm(x, p["weight"], 1e-3),
        6,
        6,
    ),
    "GELU": (ops.GELU, lambda x, p: gelu_tanh(x), 6, 6),
    "ReLU": (ops.ReLU, lambda x, p: torch.clamp_min(x, 0), 6, 6),
    "SiLU": (ops.SiLU, lambda x, p: silu(x), 6, 6),
    "SwiGLU": (ops.SwiGLU, lambda x, p: silu(x[..., :3]) * x[..., 3:], 6, 3),
    "GEGLU": (ops.GEGLU, lambda x, p: gelu_tanh(x[..., :3]) * x[..., 3:], 6, 3),
}


def _randomized(op: torch.nn.Module) -> torch.nn.Module:
    """Non-trivial parameter values (ones/zeros would hide a swapped gamma/beta gradient)."""
    with torch.no_grad():
        for p in op.parameters():
            p.copy_(torch.randn_like(p))
    return op


def _inputs(lead: tuple[int, ...], fin: int, fout: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(*lead, fin, generator=gen, dtype=D), torch.randn(*lead, fout, generator=gen, dtype=D)


@pytest.mark.parametrize("lead", [(7,), (2, 3)], ids=["2d", "3d"])
@pytest.mark.parametrize("wrap", ["standalone", "sequential"])
@pytest.mark.parametrize("name", list(CASES))
def test_op_matches_plain_torch(name: str, wrap: str, lead: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    make, ref, fin, fout = CASES[name]
    op = make()
    module = op if wrap == "standalone" else ops.Sequential(op, fusions=ops.FusionRegistry())
    x, dy = _inputs(lead, fin, fout)
    got = run_module(module, x, dy, params=op)
    assert_results_close(got, run_reference(ref, dict(op.named_parameters()), x, dy))


@pytest.mark.parametrize("name", ["Linear", "LayerNorm", "RMSNorm", "GroupedLinear"])
@pytest.mark.parametrize("frozen", ["input", "params"])
def test_frozen_input_or_params(name: str, frozen: str) -> None:
    """No gradient is produced for what does not require one; the rest still matches the reference."""
    torch.manual_seed(0)
    if name == "GroupedLinear":
        op, sizes = ops.GroupedLinear(3, 6, 5, dtype=D), [2, 0, 5]
        ref, extra, fout = (lambda x, p: grouped_ref(x, p, sizes, 3, True)), (sizes,), 5
    else:
        op = _randomized(CASES[name][0]()) if name != "Linear" else CASES[name][0]()
        ref, extra, fout = CASES[name][1], (), CASES[name][3]
    x, dy = _inputs((7,), 6, fout)
    want = run_reference(ref, dict(op.named_parameters()), x, dy)
    if frozen == "params":
        op.requires_grad_(False)
        xr = x.clone().requires_grad_()
        op(xr, *extra).backward(dy)
        torch.testing.assert_close(xr.grad, want[1], rtol=1e-10, atol=1e-12)
        assert all(p.grad is None for p in op.parameters())
    else:
        y = op(x, *extra)
        y.backward(dy)
        for n, p in op.named_parameters():
            torch.testing.assert_close(p.grad, want[2][n], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("as_tensor", [False, True])
@pytest.mark.parametrize("bias", [True, False])
def test_grouped_linear_matches_plain_torch(as_tensor: bool, bias: bool) -> None:
    torch.manual_seed(0)
    sizes = [3, 0, 4, 2]  # an empty group must get a zero gradient, not a missing one
    op = ops.GroupedLinear(4, 6, 5, bias=bias, dtype=D)
    assert [n for n, _ in op.named_parameters()] == [f"weight{g}" for g in range(4)] + (
        [f"bias{g}" for g in range(4)] if bias else []
    )
    x, dy = _inputs((9,), 6, 5)
    split = torch.tensor(sizes) if as_tensor else sizes
    got = run_module(op, x, dy, split)
    want = run_reference(lambda x, p: grouped_ref(x, p, sizes, 4, bias), dict(op.named_parameters()), x, dy)
    assert_results_close(got, want)
    torch.testing.assert_close(got[2]["weight1"], torch.zeros(5, 6, dtype=D), rtol=0, atol=0)


def test_grouped_linear_in_sequential_takes_split_sizes() -> None:
    torch.manual_seed(0)
    sizes = [2, 5]
    seq = ops.Sequential(ops.GroupedLinear(2, 6, 8, dtype=D), ops.GELU(), ops.GroupedLinear(2, 8, 5, dtype=D))
    x, dy = _inputs((7,), 6, 5)
    got = run_module(seq, x, dy, sizes, torch.tensor(sizes))

    def ref(x, p):
        h = grouped_ref(x, {k[2:]: v for k, v in p.items() if k.startswith("0.")}, sizes, 2, True)
        return grouped_ref(
            gelu_tanh(h), {k[2:]: v for k, v in p.items() if k.startswith("2.")}, sizes, 2, True
        )

    assert_results_close(got, run_reference(ref, dict(seq.named_parameters()), x, dy))


def test_rejects_a_wrong_reference() -> None:
    """Not trivially passing: the tanh GELU op must differ from the exact (erf) GELU by more than tolerance."""
    x, dy = _inputs((7,), 6, 6)
    got = run_module(ops.GELU(), x, dy)
    with pytest.raises(AssertionError):
        assert_results_close(got, run_reference(lambda x, p: F.gelu(x), {}, x, dy))
    # ... and a LayerNorm whose gamma/beta gradients were swapped is caught.
    op = _randomized(ops.LayerNorm(6, dtype=D))
    got = run_module(op, x, dy)
    swapped = (got[0], got[1], {"weight": got[2]["bias"], "bias": got[2]["weight"]})
    want = run_reference(
        lambda x, p: layer_norm(x, p["weight"], p["bias"], 1e-5), dict(op.named_parameters()), x, dy
    )
    with pytest.raises(AssertionError):
        assert_results_close(swapped, want)


def test_bad_inputs_raise_clear_errors() -> None:
    x = torch.randn(4, 6)
    with pytest.raises(ValueError, match=r"in_features=5.*\(4, 6\)"):
        ops.BasicLinear(5, 3)(x)
    with pytest.raises(ValueError, match=r"size=5"):
        ops.Bias(5)(x)
    with pytest.raises(ValueError, match=r"normalized_shape=\(5,\)"):
        ops.LayerNorm(5)(x)
    with pytest.raises(ValueError, match="even last dimension"):
        ops.SwiGLU()(torch.randn(4, 5))
    with pytest.raises(ValueError, match=r"sizes=\[1, 2\]"):
        ops.GroupedLinear(2, 6, 3)(x, [1, 2])
    with pytest.raises(ValueError, match=r"2 non-negative ints"):
        ops.GroupedLinear(2, 6, 3)(x, [5, -1])
    with pytest.raises(ValueError, match="integer"):
        ops.GroupedLinear(2, 6, 3)(x, torch.tensor([2.0, 2.0]))
    with pytest.raises(ValueError, match="1 extra input"):
        ops.GroupedLinear(2, 6, 3)(x)
    with pytest.raises(ValueError, match=r"in_features=0"):
        ops.BasicLinear(0, 3)
    with pytest.raises(ValueError, match=r"num_groups=0"):
        ops.GroupedLinear(0, 3, 3)


class _Scale(ops.BasicOperation):
    """A user-defined op: ``y = x * scale`` (the documented contract in a few lines)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.tensor(1.5, dtype=D))

    def op_forward(self, ctx, x):
        if ctx.requires_grad:
            ctx.save_for_backward(x)
        return x * self.scale

    def op_backward(self, ctx, dy):
        (x,) = ctx.saved_tensors
        return dy * self.scale, [(dy * x).sum()]


def test_user_defined_op_and_misaligned_gradients() -> None:
    x, dy = _inputs((4,), 6, 6)
    op = _Scale()
    seq = ops.Sequential(ops.Linear(6, 6, dtype=D), op)
    want = run_reference(
        lambda x, p: linear_ref(x, p["0.weight"], p["0.bias"]) * p["1.scale"],
        dict(seq.named_parameters()),
        x,
        dy,
    )
    assert_results_close(run_module(seq, x, dy), want)

    op.op_backward = lambda ctx, dy: (dy, [])  # forgets the parameter's gradient
    with pytest.raises(RuntimeError, match=r"returned 0 parameter gradient\(s\), expected 1"):
        run_module(seq, x, dy)


@pytest.mark.parametrize("lead", [(2,), ()])
def test_rmsnorm_over_several_trailing_dims_matches_torch(lead):
    """ops.RMSNorm flattens the normalised dims onto the module's RMSNorm; check that against F.rms_norm."""
    torch.manual_seed(0)
    op = ops.RMSNorm((3, 4), dtype=torch.float64)
    with torch.no_grad():
        op.weight.uniform_(0.5, 1.5)
    x = torch.randn(*lead, 3, 4, dtype=torch.float64, requires_grad=True)
    xr = x.detach().clone().requires_grad_()
    wr = op.weight.detach().clone().requires_grad_()
    dy = torch.randn(*lead, 3, 4, dtype=torch.float64)
    ops.Sequential(op)(x).backward(dy)
    torch.nn.functional.rms_norm(xr, (3, 4), wr, op.eps).backward(dy)
    torch.testing.assert_close(x.grad, xr.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(op.weight.grad, wr.grad, rtol=1e-12, atol=1e-12)
