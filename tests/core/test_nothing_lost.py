"""Issue 11 items 3 and 5: work that fails, or whose bundle is lost, stays owed until it runs or is discarded.

Why: before, a task that raised in ``backward_dw`` (no ``main_grad`` on a fused layer, an operand modified in
place) had already left the queue: ``pending_wgrad`` read 0, the optimizer guard let the step through and a
retry ran nothing. A bundle garbage-collected unrun made the guard refuse every later step, and the fix its
warning suggested (``bundle.run()``) was impossible.
"""

from __future__ import annotations

import gc

import pytest
import torch

import splitgrad
from tests.core.helpers import assert_same
from tests.helpers import grads

F64 = torch.float64


def _pair(**kw) -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        splitgrad.Linear(4, 6, params_dtype=F64, **kw),
        torch.nn.Tanh(),
        splitgrad.Linear(6, 2, params_dtype=F64, **kw),
    )
    torch.manual_seed(0)
    ref = torch.nn.Sequential(
        torch.nn.Linear(4, 6, dtype=F64), torch.nn.Tanh(), torch.nn.Linear(6, 2, dtype=F64)
    )
    ref.load_state_dict(model.state_dict())
    return model, ref


def test_failed_task_stays_owed_and_retry_runs_it_once():
    model, ref = _pair(delay_wgrad_compute=True, fuse_wgrad_accumulation=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    splitgrad.guard_optimizer(opt, model)
    x = torch.randn(5, 4, dtype=F64)
    model(x).square().sum().backward()
    ref(x).square().sum().backward()
    with pytest.raises(RuntimeError, match=r"fuse_wgrad_accumulation=True needs `weight.main_grad`"):
        splitgrad.backward_dw(model)
    assert splitgrad.pending_wgrad(model) == 2  # before: 1 (the failed task was gone)
    with pytest.raises(RuntimeError, match="still pending"):
        opt.step()
    for p in model.parameters():
        if p.dim() == 2:
            p.main_grad = torch.zeros_like(p)
    assert splitgrad.backward_dw(model) == 2
    assert splitgrad.pending_wgrad(model) == 0
    for (name, p), r in zip(model.named_parameters(), ref.parameters(), strict=True):
        got = p.main_grad if p.dim() == 2 else p.grad
        torch.testing.assert_close(got, r.grad, rtol=1e-12, atol=1e-12, msg=name)
    opt.step()


def test_version_check_failure_stays_owed_until_discarded():
    layer = splitgrad.Linear(4, 3, delay_wgrad_compute=True, params_dtype=F64)
    x = torch.randn(5, 4, dtype=F64, requires_grad=True)
    layer(x).sum().backward()
    with torch.no_grad():
        x.mul_(2)  # the saved input changes under the task
    with pytest.raises(RuntimeError, match="modified in place"):
        layer.backward_dw()
    assert splitgrad.pending_wgrad(layer) == 1 and layer.weight.grad is None
    with pytest.raises(RuntimeError, match="modified in place"):
        layer.backward_dw()  # still refused: the cause is not fixed
    assert splitgrad.discard_wgrad(layer) == 1  # giving it up is an explicit choice
    splitgrad.ensure_no_pending_wgrad(layer)
    assert layer.weight.grad is None


def test_failing_task_in_a_bundle_stays_owed_and_writes_nothing_twice():
    torch.manual_seed(0)
    mlp = splitgrad.LayerNormMLP(
        4, 8, delay_wgrad_compute=True, fuse_wgrad_accumulation=True, params_dtype=F64
    )
    torch.manual_seed(0)
    ref = splitgrad.LayerNormMLP(4, 8, params_dtype=F64)
    x = torch.randn(5, 4, dtype=F64)
    with splitgrad.capture_wgrad() as bundle:
        mlp(x).square().sum().backward()
    ref(x).square().sum().backward()
    mlp.fc2_weight.main_grad = torch.zeros_like(mlp.fc2_weight)  # fc1's is missing: the task must fail whole
    with pytest.raises(RuntimeError, match=r"fc1_weight\.main_grad"):
        bundle.run()
    assert torch.count_nonzero(mlp.fc2_weight.main_grad) == 0  # nothing half written
    assert bundle.outstanding == 1 and splitgrad.pending_wgrad(mlp) == 1
    mlp.fc1_weight.main_grad = torch.zeros_like(mlp.fc1_weight)
    assert bundle.run() == 1
    # Written once: float64-tight, not bitwise, as main_grad gets one addmm_ where the reference runs mm (another
    # BLAS kernel, rounding as the CPU dispatches); a second write would double it. The biases go to .grad
    # through the reference's own operations: bitwise.
    for name in ("fc1_weight", "fc2_weight"):
        torch.testing.assert_close(
            getattr(mlp, name).main_grad, getattr(ref, name).grad, rtol=1e-12, atol=1e-12, msg=name
        )
    for name in ("fc1_bias", "fc2_bias"):
        torch.testing.assert_close(getattr(mlp, name).grad, getattr(ref, name).grad, rtol=0, atol=0, msg=name)
    splitgrad.ensure_no_pending_wgrad(mlp)


def test_garbage_collected_bundle_has_a_working_way_out():
    model, ref = _pair(delay_wgrad_compute=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    splitgrad.guard_optimizer(opt, model)
    x = torch.randn(5, 4, dtype=F64)
    with splitgrad.capture_wgrad() as bundle:
        model(x).square().sum().backward()
    ref(x).square().sum().backward()
    with pytest.warns(
        RuntimeWarning, match=r"splitgrad\.backward_dw\(model\).*splitgrad\.discard_wgrad\(model\)"
    ):
        del bundle
        gc.collect()
    with pytest.raises(RuntimeError, match="still pending"):
        opt.step()
    assert splitgrad.backward_dw(model) == 2  # the way the warning and the guard suggest: it works
    assert_same(grads(model), grads(ref), exact=False)
    opt.step()


def test_garbage_collected_bundle_can_be_discarded_on_purpose():
    model, _ = _pair(delay_wgrad_compute=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    splitgrad.guard_optimizer(opt, model)
    with splitgrad.capture_wgrad() as bundle:
        model(torch.randn(5, 4, dtype=F64)).sum().backward()
    with pytest.warns(RuntimeWarning, match="garbage collected"):
        del bundle
        gc.collect()
    assert splitgrad.discard_wgrad(model) == 2
    opt.step()
    assert all(p.grad is None for p in model.parameters())
