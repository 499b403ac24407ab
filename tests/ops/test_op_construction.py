"""Construction of the ops that share a base (``NormOperation``, ``SplitOperation``): checks, parameters, repr.

Why: ``ops.LayerNorm``/``ops.RMSNorm`` and ``ops.BasicLinear``/``ops.GroupedLinear`` each share one
constructor; these tests pin what every one of them must still say, register and initialise (the drop-in
promise: ``nn.LayerNorm``/``nn.RMSNorm``/``nn.Linear`` parameters and state_dict).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from splitgrad import ops


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: ops.LayerNorm(4, eps=-0.1), "ops.LayerNorm needs eps >= 0, got eps=-0.1"),
        (lambda: ops.RMSNorm(4, eps=-1), "ops.RMSNorm needs eps >= 0, got eps=-1"),
        (
            lambda: ops.LayerNorm((3, 0)),
            "ops.LayerNorm needs positive normalized_shape, got normalized_shape=(3, 0)",
        ),
        (lambda: ops.RMSNorm(0), "ops.RMSNorm needs positive normalized_shape, got normalized_shape=0"),
    ],
    ids=["LayerNorm-eps", "RMSNorm-eps", "LayerNorm-shape", "RMSNorm-shape"],
)
def test_norm_bad_arguments_name_the_op(make, message):
    with pytest.raises(ValueError) as err:
        make()
    assert str(err.value) == message


@pytest.mark.parametrize(
    ("ours", "torchs"),
    [
        (lambda: ops.LayerNorm((2, 3), eps=1e-3), lambda: nn.LayerNorm((2, 3), eps=1e-3)),
        (lambda: ops.RMSNorm(5, dtype=torch.float64), lambda: nn.RMSNorm(5, dtype=torch.float64)),
    ],
    ids=["LayerNorm", "RMSNorm"],
)
def test_norm_parameters_match_torch(ours, torchs):
    op, ref = ours(), torchs()
    assert list(op.state_dict()) == list(ref.state_dict())
    for name, value in ref.state_dict().items():
        torch.testing.assert_close(op.state_dict()[name], value, rtol=0, atol=0)
    assert repr(op).endswith(f"({op.normalized_shape}, eps={op.eps})")
    # Not trivially passing: a perturbed parameter is told apart.
    with torch.no_grad():
        op.weight.add_(1e-3)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(op.weight, ref.weight, rtol=0, atol=0)


@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("delay", [False, True])
def test_split_ops_report_their_switches(delay, accumulate):
    kwargs = {"delay_wgrad_compute": delay, "accumulate_into_main_grad": accumulate}
    for op in (
        ops.BasicLinear(3, 4, **kwargs),
        ops.GroupedLinear(2, 3, 4, **kwargs),
        ops.Linear(3, 4, **kwargs),
    ):
        assert op.accumulate_into_main_grad is accumulate and op.fuse_wgrad_accumulation is accumulate
        assert op.need_backward_dw() is delay
        assert repr(op).endswith(f"delay_wgrad_compute={delay}, accumulate_into_main_grad={accumulate})")


def test_split_ops_initialise_like_nn_linear():
    torch.manual_seed(3)
    ref = nn.Linear(3, 4)
    torch.manual_seed(3)
    basic = ops.BasicLinear(3, 4)
    torch.manual_seed(3)
    grouped = ops.GroupedLinear(2, 3, 4)
    torch.testing.assert_close(basic.weight, ref.weight, rtol=0, atol=0)
    torch.testing.assert_close(grouped.weight0, ref.weight, rtol=0, atol=0)
    # Not trivially passing: the second group draws its own values.
    assert not torch.equal(grouped.weight1, ref.weight)
    assert list(grouped.state_dict()) == ["weight0", "weight1", "bias0", "bias1"]
