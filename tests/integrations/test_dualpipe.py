"""splitgrad layers in DeepSeek's DualPipe (the real ``dualpipe`` package, pinned in requirements-frameworks.txt).

Why: DualPipe's zero-bubble steps expect layers to ``put`` their weight-gradient closures into its
``WeightGradStore``; :mod:`splitgrad.integrations.dualpipe` makes splitgrad layers do that. The package's own
``DualPipe`` runs with them on 2 and 4 gloo ranks, checked as DualPipe's example checks itself and against
plain float64 autograd and splitgrad's runtime ``dualpipev``. PyPI's dualpipe 1.0.0 has no ``DualPipeV``, so
torch's ``ScheduleDualPipeV`` (the same order) runs with splitgrad adapter stages instead.
"""

from __future__ import annotations

import pytest
import torch

import splitgrad
from splitgrad.integrations import dualpipe as bridge
from splitgrad.testing import spawn
from tests.helpers import rank_failures

from . import dualpipe_checks


@pytest.fixture(scope="module", params=[2, 4], ids=["2ranks", "4ranks"])
def results(request) -> list[dict[str, str | None]]:
    return spawn(dualpipe_checks.run_checks, request.param, dualpipe_checks.ALL, timeout=300, pg_timeout=60)


@pytest.mark.distributed
@pytest.mark.parametrize("name", dualpipe_checks.ALL)
def test_dualpipe(results, name):
    failures = rank_failures(results, name)
    assert not failures, failures


# -- the bridge's bookkeeping, in one process with DualPipe's own WeightGradStore ------------------------------
@pytest.fixture
def dp_store():
    """DualPipe's class-level store, emptied and disabled again after the test."""
    from dualpipe import WeightGradStore

    WeightGradStore.clear()
    yield WeightGradStore
    WeightGradStore.enabled = False
    WeightGradStore.clear()


def layer(delay: bool = True) -> splitgrad.Linear:
    torch.manual_seed(0)
    return splitgrad.Linear(4, 3, delay_wgrad_compute=delay, params_dtype=torch.float64)


def backward(module: torch.nn.Module, dp_store, *, enabled: bool) -> torch.Tensor:
    """One backward the way DualPipe runs it (its ``_backward_compute_chunk``); returns the input."""
    x = torch.randn(2, 4, dtype=torch.float64)
    dp_store.enabled = enabled
    module(x).sum().backward()
    dp_store.enabled = False
    if enabled:
        dp_store.flush()
    return x


def test_work_goes_to_dualpipe_while_enabled_and_runs_now_otherwise(dp_store):
    module = layer()
    with bridge.attach(module):
        x0 = backward(module, dp_store, enabled=True)
        assert module.weight.grad is None and splitgrad.pending_wgrad(module) == 1  # owed, in both accounts
        assert dp_store.funcs_queue.qsize() == 1
        x1 = backward(module, dp_store, enabled=False)  # DualPipe's full backward
        torch.testing.assert_close(module.weight.grad, torch.ones(2, 3, dtype=torch.float64).t() @ x1)
        dp_store.pop()  # DualPipe's W step
        assert splitgrad.pending_wgrad(module) == 0
        ones = torch.ones(4, 3, dtype=torch.float64)
        torch.testing.assert_close(module.weight.grad, ones.t() @ torch.cat([x0, x1]), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(module.bias.grad, torch.full((3,), 4.0, dtype=torch.float64))


def test_nothing_lost_or_run_twice(dp_store):
    module = layer()
    with bridge.attach(module):
        backward(module, dp_store, enabled=True)
        with pytest.raises(RuntimeError, match="pending"):
            splitgrad.ensure_no_pending_wgrad(module)  # the optimizer guard sees DualPipe's pending W
        splitgrad.backward_dw(module)  # run by splitgrad first ...
        with pytest.raises(RuntimeError, match="already ran"):
            dp_store.pop()  # ... so DualPipe's call refuses to write it again
        grad = module.weight.grad.clone()
        backward(module, dp_store, enabled=True)
        dp_store.clear()  # DualPipe dropped its queue (a failed step): the work stays owed in splitgrad
        assert splitgrad.pending_wgrad(module) == 1
        assert splitgrad.discard_wgrad(module) == 1  # given up on purpose, loudly
        torch.testing.assert_close(module.weight.grad, grad, rtol=0, atol=0)
    backward(module, dp_store, enabled=True)  # detached: back to backward_dw
    assert dp_store.funcs_queue.qsize() == 1 and not dp_store.funcs_queue.queue[0]
    assert splitgrad.backward_dw(module) == 1


def test_attach_refuses_what_dualpipe_cannot_drive(dp_store):
    with pytest.raises(ValueError, match="no splitgrad layer"):
        bridge.attach(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"\['Linear'\] were built without delay_wgrad_compute=True"):
        bridge.attach(layer(delay=False))
    module = layer()
    with bridge.attach(module), pytest.raises(ValueError, match="attached twice"):
        bridge.attach(module)
