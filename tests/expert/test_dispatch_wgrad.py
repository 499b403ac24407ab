"""``run_expert_wgrad``: the deferred expert W run early (inside the dispatch) only where that keeps the order.

Why: running a microbatch's expert weight gradients inside its backward dispatch must write exactly what
``backward_dw`` / the bundle would have written, in the same accumulation order, settle each task where it was
owed and fire the hooks once. Where older work of the same layer is still owed elsewhere (another bundle not yet
run), running the new task first would reorder the accumulation, so it must leave everything deferred. These
paths are checked here without processes, on the ``GroupedLinear`` experts themselves, in float64.
"""

from __future__ import annotations

import pytest
import torch

import splitgrad
from splitgrad.parallel.expert.dispatch_wgrad import run_expert_wgrad

SPLITS = [3, 0, 2]  # an empty expert too


def _experts(delayed: bool = True):
    torch.manual_seed(0)
    fc1 = splitgrad.GroupedLinear(3, 4, 6, delay_wgrad_compute=delayed, params_dtype=torch.float64)
    fc2 = splitgrad.GroupedLinear(3, 6, 4, delay_wgrad_compute=delayed, params_dtype=torch.float64)
    fires = {"fc1": 0, "fc2": 0}
    for name, fc in (("fc1", fc1), ("fc2", fc2)):
        fc.register_wgrad_accumulation_and_reduce_hooks(lambda n=name: fires.__setitem__(n, fires[n] + 1))
    return fc1, fc2, fires


def _backward(fc1, fc2, seed: int) -> None:
    x = torch.randn(sum(SPLITS), 4, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    fc2(torch.relu(fc1(x, SPLITS)), SPLITS).square().sum().backward()


def _grads(*modules):
    return [p.grad.clone() for m in modules for p in m.parameters()]


def _reference():
    fc1, fc2, _ = _experts()
    for seed in (1, 2):
        _backward(fc1, fc2, seed)
    splitgrad.backward_dw(fc1)
    splitgrad.backward_dw(fc2)
    return _grads(fc1, fc2)


def test_queued_work_runs_in_fifo_order_hooks_once():
    fc1, fc2, fires = _experts()
    _backward(fc1, fc2, 1)
    _backward(fc1, fc2, 2)  # two backwards queued: both run, oldest first, as backward_dw would
    log: list = []
    assert run_expert_wgrad([fc1, fc2], log) == 4
    assert fires == {"fc1": 2, "fc2": 2} and splitgrad.pending_wgrad(fc1) + splitgrad.pending_wgrad(fc2) == 0
    assert [name for name, _, _ in log] == ["expert wgrad"] and log[0][1] <= log[0][2]
    for got, want in zip(_grads(fc1, fc2), _reference()):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert run_expert_wgrad([fc1, fc2], log) == 0 and len(log) == 1  # nothing owed: nothing runs twice
    with pytest.raises(RuntimeError, match="no pending weight-gradient work"):
        fc1.backward_dw()  # the queue really is empty (not trivially passing: a second run is refused)


def test_bundle_tasks_run_and_the_bundle_skips_them():
    fc1, fc2, fires = _experts()
    with splitgrad.capture_wgrad() as bundle:
        _backward(fc1, fc2, 1)
        assert run_expert_wgrad([fc1, fc2]) == 2  # inside the open capture, as in the runtime's B action
    assert fires == {"fc1": 1, "fc2": 1} and bundle.outstanding == 0
    assert bundle.run() == 0 and fires == {"fc1": 1, "fc2": 1}  # the W action later: nothing run twice
    with splitgrad.capture_wgrad() as second:
        _backward(fc1, fc2, 2)
    second.run()
    for got, want in zip(_grads(fc1, fc2), _reference()):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_older_bundle_owed_elsewhere_leaves_the_work_deferred():
    fc1, fc2, fires = _experts()
    with splitgrad.capture_wgrad() as older:
        _backward(fc1, fc2, 1)
    with splitgrad.capture_wgrad() as newer:
        _backward(fc1, fc2, 2)
        # Running microbatch 2 first would accumulate it before microbatch 1: refused, nothing runs.
        assert run_expert_wgrad([fc1, fc2]) == 0
    assert older.outstanding == 2 and newer.outstanding == 2 and fires == {"fc1": 0, "fc2": 0}
    older.run()
    newer.run()
    for got, want in zip(_grads(fc1, fc2), _reference()):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_immediate_experts_have_nothing_to_run():
    fc1, fc2, fires = _experts(delayed=False)
    _backward(fc1, fc2, 1)
    assert run_expert_wgrad([fc1, fc2]) == 0 and fires == {"fc1": 0, "fc2": 0}
    assert all(p.grad is not None for p in fc1.parameters())
