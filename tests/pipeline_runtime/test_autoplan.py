"""Profile-guided zb-auto in the runtime: measure on warm-up steps, plan, install, keep gradients exact.

Why: the plan changes when each W runs, never what it computes, so the steps after planning must give the
profiling step's gradients bit for bit; the plan must use what was measured (costs, M_B and M_W bytes) and
respect the memory budget. One process (a one-rank pipeline) checks the logic; the 2-rank spawn in
``test_runtime_distributed.py`` checks it across ranks.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import splitgrad
from splitgrad.pipeline import build_runtime, simulate


def _blocks() -> list[nn.Module]:
    torch.manual_seed(3)
    kw = {"delay_wgrad_compute": True, "params_dtype": torch.float64}
    return [splitgrad.Linear(8, 16, **kw), nn.Tanh(), splitgrad.Linear(16, 4, **kw)]


def _grads(rt) -> list[torch.Tensor]:
    return [p.grad.clone() for p in rt.parameters()]


def test_profiles_then_plans_and_stays_exact():
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(8, 8, generator=gen, dtype=torch.float64)
    y = torch.randn(8, 4, generator=gen, dtype=torch.float64)
    rt = build_runtime([nn.Sequential(*_blocks())], "auto", n_microbatches=4, loss_fn=F.mse_loss)
    assert rt.schedule.name == "1f1b" and rt.planner.plan is None
    first = rt.step(x, y)
    profiled = _grads(rt)
    plan = rt.planner.plan
    assert plan is not None and rt.schedule.name == "zb-auto" and rt.schedule is plan.schedule
    assert all(v > 0 for v in plan.f + plan.b + plan.w)
    # This stack keeps for W what its forward saved (inputs and output gradients of the Linears; the weights
    # are parameters, not activations): M_W = M_B here.
    assert plan.activation_bytes[0] >= plan.wgrad_bytes[0] > 0
    assert plan.w_memory == pytest.approx(plan.wgrad_bytes[0] / plan.activation_bytes[0])
    assert plan.memory_limit == (1.0,)
    assert plan.predicted_bubble == simulate(plan.schedule, plan.f, plan.b, plan.w, plan.comm).bubble_ratio
    assert rt.executor.meter is None  # metering was only for the profile
    rt.zero_grad()
    second = rt.step(x, y)
    assert second.loss.item() == first.loss.item()
    for a, b in zip(_grads(rt), profiled):
        assert torch.equal(a, b)
    # Not trivially passing: a different batch gives different gradients.
    rt.zero_grad()
    rt.step(x + 1, y)
    assert not all(torch.equal(a, b) for a, b in zip(_grads(rt), profiled))
    assert "planned" in rt.timeline_report(second)


def test_memory_budget_in_bytes_and_in_1f1b_equivalents():
    stage = nn.Sequential(*_blocks())
    x, y = torch.randn(8, 8, dtype=torch.float64), torch.randn(8, 4, dtype=torch.float64)
    rt = build_runtime(
        [stage], "zb-auto", n_microbatches=4, loss_fn=F.mse_loss, schedule_options={"memory_budget": 3.0}
    )
    rt.step(x, y)
    assert rt.planner.plan.memory_limit == (3.0,)
    rt.zero_grad()
    rt = build_runtime(
        [stage], "auto", n_microbatches=4, loss_fn=F.mse_loss, schedule_options={"memory_budget_bytes": 10**9}
    )
    rt.step(x, y)
    plan = rt.planner.plan
    assert plan.memory_limit[0] == pytest.approx(10**9 / plan.activation_bytes[0])


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"memory_budget": -1.0}, "memory_budget must be > 0"),
        ({"memory_budget": 1.0, "memory_budget_bytes": 10}, "not both"),
        ({"profile_steps": 0}, "profile_steps must be an integer >= 1"),
        ({"split_backward": True}, "takes schedule_options memory_budget"),
    ],
)
def test_bad_options_are_named(options, match):
    with pytest.raises(ValueError, match=match):
        build_runtime(
            [nn.Sequential(*_blocks())],
            "auto",
            n_microbatches=4,
            loss_fn=F.mse_loss,
            schedule_options=options,
        )
