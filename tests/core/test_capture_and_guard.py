"""capture_wgrad bundles, the optimizer guard, and every error path of the core.

Why: a pipeline W step runs one microbatch's bundle in any order; a lost or doubled W step must be loud.
"""

from __future__ import annotations

import gc
import re

import pytest
import torch

import splitgrad
from splitgrad.core.bundle import active_bundle
from tests.core.helpers import assert_same
from tests.helpers import grads


def _pair(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        splitgrad.Linear(4, 6, delay_wgrad_compute=True, params_dtype=torch.float64),
        torch.nn.Tanh(),
        splitgrad.Linear(6, 2, delay_wgrad_compute=True, params_dtype=torch.float64),
    )
    ref = torch.nn.Sequential(
        torch.nn.Linear(4, 6, dtype=torch.float64),
        torch.nn.Tanh(),
        torch.nn.Linear(6, 2, dtype=torch.float64),
    )
    ref.load_state_dict(model.state_dict())
    return model, ref


def test_bundles_run_out_of_order_give_reference_grads():
    model, ref = _pair()
    xs = [torch.randn(3, 4, dtype=torch.float64) for _ in range(3)]
    bundles = []
    for x in xs:
        with splitgrad.capture_wgrad() as bundle:
            model(x).pow(2).sum().backward()
        ref(x).pow(2).sum().backward()
        assert len(bundle) == 2  # one task per layer
        bundles.append(bundle)
    assert splitgrad.queued_wgrad(model) == 0  # parked in bundles, not in the queues
    with pytest.raises(RuntimeError, match="capture_wgrad bundles"):
        model[0].backward_dw()
    for i in (2, 0, 1):
        assert bundles[i].run() == 2
    assert_same(grads(model), grads(ref), exact=False)
    splitgrad.ensure_no_pending_wgrad(model)


def test_nested_captures_go_to_the_innermost():
    model, _ = _pair()
    with splitgrad.capture_wgrad() as outer:
        model(torch.randn(3, 4, dtype=torch.float64)).sum().backward()
        with splitgrad.capture_wgrad() as inner:
            model(torch.randn(3, 4, dtype=torch.float64)).sum().backward()
    assert len(outer) == 2 and len(inner) == 2
    outer.run()
    inner.run()


def test_guard_optimizer_refuses_step_while_work_is_owed():
    model, _ = _pair()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    handle = splitgrad.guard_optimizer(opt, model)
    model(torch.randn(3, 4, dtype=torch.float64)).sum().backward()
    with pytest.raises(RuntimeError, match=r"SGD\.step\(\).*Owed by: 0 \(pending=1.*2 \(pending=1"):
        opt.step()
    splitgrad.backward_dw(model)
    opt.step()
    with splitgrad.capture_wgrad() as bundle:
        model(torch.randn(3, 4, dtype=torch.float64)).sum().backward()
    with pytest.raises(RuntimeError, match="in bundles=1"):
        opt.step()
    assert bundle.discard() == 2
    opt.step()  # discarding is an explicit decision, so the guard lets it through
    model(torch.randn(3, 4, dtype=torch.float64)).sum().backward()
    handle.remove()
    opt.step()  # guard lifted
    assert splitgrad.pending_wgrad(model) == 2


def test_dropped_bundle_warns_and_stays_owed():
    model, _ = _pair()
    with splitgrad.capture_wgrad() as bundle:
        model(torch.randn(3, 4, dtype=torch.float64)).sum().backward()
    with pytest.warns(RuntimeWarning, match="garbage collected"):
        del bundle
        gc.collect()
    # Still owed, now in the queues (see tests/core/test_nothing_lost.py for the way out).
    with pytest.raises(RuntimeError, match="pending=1"):
        splitgrad.ensure_no_pending_wgrad(model)


def test_error_backward_dw_without_pending_names_module():
    layer = splitgrad.Linear(3, 2, delay_wgrad_compute=True)
    with pytest.raises(
        RuntimeError, match=re.escape("Linear(in_features=3, out_features=2, bias=True).backward_dw()")
    ):
        layer.backward_dw()


def test_error_missing_or_misshaped_main_grad():
    layer = splitgrad.Linear(3, 2, fuse_wgrad_accumulation=True)
    with pytest.raises(RuntimeError, match=r"weight\.main_grad"):
        layer(torch.randn(2, 3)).sum().backward()
    delayed = splitgrad.Linear(3, 2, delay_wgrad_compute=True, fuse_wgrad_accumulation=True)
    delayed.weight.main_grad = torch.zeros(3, 2)
    delayed(torch.randn(2, 3)).sum().backward()
    with pytest.raises(RuntimeError, match=r"main_grad` has shape \(3, 2\), expected \(2, 3\)"):
        delayed.backward_dw()


def test_error_bad_input_and_constructor_args():
    layer = splitgrad.Linear(3, 2)
    with pytest.raises(ValueError, match=r"in_features=3.*\(2, 4\)"):
        layer(torch.randn(2, 4))
    with pytest.raises(ValueError, match="in_features=0"):
        splitgrad.Linear(0, 2)
    with pytest.raises(TypeError, match="callable"):
        layer.register_wgrad_accumulation_and_reduce_hooks(42)


def test_error_input_modified_in_place_before_backward_dw():
    layer = splitgrad.Linear(3, 2, delay_wgrad_compute=True)
    x = torch.randn(2, 3)
    layer(x).sum().backward()
    x.mul_(2)  # the saved operand of the deferred wgrad changed
    with pytest.raises(RuntimeError, match="modified in place"):
        layer.backward_dw()


def test_error_captures_exited_out_of_order():
    outer = splitgrad.capture_wgrad()
    inner = splitgrad.capture_wgrad()
    outer.__enter__()
    inner_bundle = inner.__enter__()
    with pytest.raises(RuntimeError, match="reverse order"):
        outer.__exit__(None, None, None)
    # The misused block is gone, the open one stays.
    assert active_bundle() is inner_bundle
    inner.__exit__(None, None, None)
    assert active_bundle() is None


def test_store_clear_is_loud_and_counts():
    layer = splitgrad.Linear(3, 2, delay_wgrad_compute=True)
    layer(torch.randn(2, 3)).sum().backward()
    assert layer.wgrad_store.clear() == 1
    assert splitgrad.pending_wgrad(layer) == 0


def test_copy_and_pickle_of_idle_modules_only():
    import copy
    import pickle

    layer = splitgrad.Linear(3, 2, delay_wgrad_compute=True)
    clone = copy.deepcopy(layer)
    clone(torch.randn(2, 3)).sum().backward()
    assert splitgrad.pending_wgrad(clone) == 1 and splitgrad.pending_wgrad(layer) == 0  # separate stores
    restored = pickle.loads(pickle.dumps(layer))
    assert restored.need_backward_dw() and restored.weight.skip_backward_post_hook
    with pytest.raises(RuntimeError, match="pending wgrad work"):
        copy.deepcopy(clone)
    clone.backward_dw()
    copy.deepcopy(clone)


def test_wgrad_runs_without_recording_autograd_history():
    """Saved operands can be views of tensors requiring grad; W must not attach a grad_fn to the gradients."""
    for fused in (False, True):
        layer = splitgrad.Linear(8, 8, bias=False, delay_wgrad_compute=True, fuse_wgrad_accumulation=fused)
        layer.weight.main_grad = torch.zeros(8, 8)
        x = torch.randn(2, 3, 8, requires_grad=True)
        with splitgrad.capture_wgrad() as bundle:
            layer(x * 2).backward(torch.randn(2, 3, 8))
        assert bundle.saved_bytes() == (2 * 3 * 8 + 2 * 3 * 8) * 4  # dy and x: what B keeps alive until W
        bundle.run()
        assert bundle.saved_bytes() == 0
        written = layer.weight.main_grad if fused else layer.weight.grad
        assert not written.requires_grad and written.grad_fn is None
