"""A graphed callable's pending wgrad replay is owed work: the whole-model guard must see it.

Why: replay runs no Python, so without bookkeeping in the stores `guard_optimizer` would let `step()` run
over weight gradients that a wgrad graph has not written yet.
"""

from __future__ import annotations

import gc

import pytest
import torch

import splitgrad
from splitgrad.testing import CpuGraphBackend
from tests.helpers import make_graphed

from .helpers import mlp, seeded


def test_pending_wgrad_replay_blocks_the_optimizer_guard():
    model = seeded(lambda: mlp(delay=True))
    x = torch.randn(3, 6, requires_grad=True)
    (graphed,) = make_graphed((model,), ((x,),), backend=CpuGraphBackend())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    splitgrad.guard_optimizer(opt, model)
    graphed(x).sum().backward()
    with pytest.raises(RuntimeError, match="in graphs=1"):
        opt.step()
    graphed.backward_dw()
    opt.step()  # settled by the replay
    splitgrad.ensure_no_pending_wgrad(model)


def test_garbage_collected_graph_warns_and_stops_counting():
    model = seeded(lambda: mlp(delay=True))
    x = torch.randn(3, 6, requires_grad=True)
    (graphed,) = make_graphed((model,), ((x,),), backend=CpuGraphBackend())
    graphed(x).sum().backward()
    with pytest.raises(RuntimeError, match="in graphs"):
        splitgrad.ensure_no_pending_wgrad(model)
    with pytest.warns(RuntimeWarning, match="pending wgrad replay"):
        del graphed
        gc.collect()
    splitgrad.ensure_no_pending_wgrad(model)
