"""Property test: any interleaving of forward/backward/backward_dw gives immediate mode's gradients bitwise.

Why: pipeline schedules interleave W steps arbitrarily with later forwards/backwards; FIFO tasks must make
the accumulation order (and so every bit) independent of when W runs.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import splitgrad
from tests.core.helpers import assert_same
from tests.helpers import grads


def _model(delay: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        splitgrad.Linear(5, 7, delay_wgrad_compute=delay),
        torch.nn.GELU(),
        splitgrad.Linear(7, 3, delay_wgrad_compute=delay),
    )


@settings(max_examples=25, deadline=None)
@given(
    n_mb=st.integers(1, 5),
    plan=st.lists(st.integers(0, 3), min_size=5, max_size=5),
    use_bundles=st.booleans(),
)
def test_random_interleavings_match_immediate(n_mb, plan, use_bundles):
    xs = [torch.randn(4, 5, generator=torch.Generator().manual_seed(i)) for i in range(n_mb)]
    ref = _model(False)
    for x in xs:
        ref(x).square().sum().backward()

    model = _model(True)
    bundles = []
    for i, x in enumerate(xs):
        if use_bundles:
            with splitgrad.capture_wgrad() as b:
                model(x).square().sum().backward()
            bundles.append(b)
        else:
            model(x).square().sum().backward()
        # After microbatch i, run up to plan[i] of the oldest pending W steps.
        for _ in range(min(plan[i], len(bundles) if use_bundles else len(model[0].wgrad_store))):
            if use_bundles:
                bundles.pop(0).run()
            else:
                model[0].backward_dw()
                model[2].backward_dw()
    for b in bundles:
        b.run()
    splitgrad.backward_dw(model)
    splitgrad.ensure_no_pending_wgrad(model)
    assert_same(grads(model), grads(ref), exact=True)
