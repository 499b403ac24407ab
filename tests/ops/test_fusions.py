"""Fusions: each fused path against the same ops unfused and against float64 plain PyTorch.

Why: a fusion rewrites *how* ops run, never *what* they compute. The forward fusion may differ from the
unfused ops only by float rounding (one addmm instead of mm + add); the backward fusion does the same
arithmetic and must be bitwise equal. A fusion that drops or reorders an op must be rejected by the fuser.
"""

from __future__ import annotations

import pytest
import torch

from splitgrad import ops
from splitgrad.ops.fuser import OperationFuser
from tests.ops._reference import (
    assert_results_close,
    assert_results_equal,
    gelu_tanh,
    linear_ref,
    run_module,
    run_reference,
    silu,
)

D = torch.float64
ACTS = {
    "none": (None, lambda z: z, 5),
    "GELU": (ops.GELU, gelu_tanh, 5),
    "ReLU": (ops.ReLU, lambda z: torch.clamp_min(z, 0), 5),
    "SiLU": (ops.SiLU, silu, 5),
    "SwiGLU": (ops.SwiGLU, lambda z: silu(z[..., :3]) * z[..., 3:], 3),
    "GEGLU": (ops.GEGLU, lambda z: gelu_tanh(z[..., :3]) * z[..., 3:], 3),
}


def _block(act_name: str, fusions: ops.FusionRegistry | None) -> ops.Sequential:
    torch.manual_seed(0)
    width = 6 if act_name in ("SwiGLU", "GEGLU") else 5
    act = ACTS[act_name][0]
    mods = [ops.BasicLinear(4, width, dtype=D), ops.Bias(width, dtype=D)] + ([act()] if act else [])
    seq = ops.Sequential(*mods, fusions=fusions)
    with torch.no_grad():
        seq[1].bias.normal_()
    return seq


def _data(fout: int, lead=(3, 5)):
    gen = torch.Generator().manual_seed(2)
    return torch.randn(*lead, 4, generator=gen, dtype=D), torch.randn(*lead, fout, generator=gen, dtype=D)


@pytest.mark.parametrize("act_name", list(ACTS))
def test_fused_matches_unfused_and_plain_torch(act_name: str) -> None:
    _, act_ref, fout = ACTS[act_name]
    fused, unfused = _block(act_name, None), _block(act_name, ops.FusionRegistry())
    (fuser,) = fused.fusers
    assert isinstance(fuser.forward_ops[0], ops.fused.ForwardLinearBiasActivation)
    assert len(fuser.forward_ops) == 1
    if act_name != "none":
        assert isinstance(fuser.backward_ops[1], ops.fused.BackwardActivationBias)
    assert all(isinstance(op, ops.BasicOperation) for op in unfused.fusers[0].forward_ops)

    x, dy = _data(fout)
    got, base = run_module(fused, x, dy), run_module(unfused, x, dy)
    assert_results_close(got, base, rtol=1e-13, atol=1e-14)
    ref = run_reference(
        lambda x, p: act_ref(linear_ref(x, p["0.weight"], p["1.bias"])), dict(fused.named_parameters()), x, dy
    )
    assert_results_close(got, ref)


@pytest.mark.parametrize("act_name", ["GELU", "ReLU", "SwiGLU"])
def test_backward_fusion_is_bitwise(act_name: str) -> None:
    """Backward-only fusion (forward fusions off) changes nothing, to the bit."""
    only_bwd = ops.FusionRegistry(backward=[ops.fused.fuse_backward_activation_bias])
    fused, unfused = _block(act_name, only_bwd), _block(act_name, ops.FusionRegistry())
    assert isinstance(fused.fusers[0].backward_ops[1], ops.fused.BackwardActivationBias)
    x, dy = _data(ACTS[act_name][2])
    assert_results_equal(run_module(fused, x, dy), run_module(unfused, x, dy))


def test_forward_fusion_matches_nn_linear_bitwise() -> None:
    """Fused Linear+Bias is ``F.linear`` with bias: exactly what ``nn.Linear`` computes."""
    torch.manual_seed(0)
    lin = ops.Linear(4, 5, dtype=D)
    ref = torch.nn.Linear(4, 5, dtype=D)
    ref.load_state_dict(lin.state_dict())
    x, dy = _data(5)
    assert_results_equal(run_module(lin, x, dy), run_module(ref, x, dy))


def test_fusion_skips_non_matching_windows() -> None:
    seq = ops.Sequential(
        ops.BasicLinear(4, 5),
        ops.LayerNorm(5),  # breaks the window
        ops.Bias(5),
        ops.GELU(),
        ops.BasicLinear(5, 5, dtype=D),  # dtype differs from the bias that follows
        ops.Bias(5),
    )
    fwd, bwd = seq.fusers[0].forward_ops, seq.fusers[0].backward_ops
    assert not any(isinstance(op, ops.fused.ForwardLinearBiasActivation) for op in fwd)
    assert [type(op).__name__ for op in bwd].count("BackwardActivationBias") == 1


def test_non_op_module_splits_fusion_runs() -> None:
    seq = ops.Sequential(ops.BasicLinear(4, 5), torch.nn.Identity(), ops.Bias(5), ops.GELU())
    assert len(seq.fusers) == 2
    assert not any(
        isinstance(op, ops.fused.ForwardLinearBiasActivation) for f in seq.fusers for op in f.forward_ops
    )


def test_registering_a_fusion_replans_and_a_broken_fusion_is_rejected() -> None:
    """Not trivially passing: a fusion that drops an op must raise, not silently skip a layer."""
    seq = ops.Sequential(ops.BasicLinear(4, 5), ops.Bias(5), ops.GELU())
    x = torch.randn(3, 4)
    seq(x)
    seq.fusions.register_forward(lambda ops_: ops_[:-1])
    with pytest.raises(RuntimeError, match="did not keep the basic ops in order"):
        seq(x)
    stray = ops.FusionRegistry(backward=[lambda ops_: [*ops_, None]])
    with pytest.raises(TypeError, match="returned non-ops"):
        OperationFuser(list(seq), stray).plans()
    with pytest.raises(TypeError, match="callable"):
        seq.fusions.register_backward("not a function")

    calls = []
    registry = ops.FusionRegistry()
    seq2 = ops.Sequential(ops.ReLU(), fusions=registry)
    seq2(x)

    @registry.register_forward
    def spy(ops_):
        calls.append(len(ops_))
        return ops_

    seq2(x)
    seq2(x)
    assert calls == [1], "a new fusion is applied once, then the plan is cached"


def test_fused_op_must_wrap_two_ops_and_declares_its_direction() -> None:
    with pytest.raises(ValueError, match="at least two"):
        ops.fused.BackwardActivationBias.__mro__[1]([ops.ReLU()])
    fused = ops.fused.ForwardLinearBiasActivation(ops.BasicLinear(2, 2), ops.Bias(2))
    with pytest.raises(NotImplementedError, match="not a backward fusion"):
        fused.fuser_backward([], torch.zeros(1))
