"""Issue 11 item 6: deepcopy and pickle of an idle split layer keep every attribute of the contract.

Why: ``copy.deepcopy`` makes new Parameters without their Python attributes, so a copied delayed layer lost
``skip_backward_post_hook`` (and splitgrad's own DDP then mis-counted a layer used twice).
"""

from __future__ import annotations

import copy
import io

import pytest
import torch

import splitgrad
from splitgrad import ops
from tests.core.split_cases import CASES, inputs, loss_of, param_grads

IDS = [c.name for c in CASES]


def _contract(layer: torch.nn.Module) -> dict:
    params = {id(p): n for n, p in layer.named_parameters()}
    splits = [m for _, m in splitgrad.split_modules(layer)]
    return {
        "need_backward_dw": [m.need_backward_dw() for m in splits],
        "fuse": [bool(m.fuse_wgrad_accumulation) for m in splits],
        "dw_params": [params[id(p)] for p in layer.get_backward_dw_params()],
        "skip": {n: getattr(p, "skip_backward_post_hook", None) for n, p in layer.named_parameters()},
        "store": [(m.wgrad_store.name, m.wgrad_store.delay_wgrad_compute()) for m in splits],
    }


def _pickled(layer: torch.nn.Module) -> torch.nn.Module:
    buf = io.BytesIO()
    torch.save(layer, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


@pytest.mark.parametrize("case", CASES, ids=IDS)
@pytest.mark.parametrize("copier", [copy.deepcopy, _pickled], ids=["deepcopy", "pickle"])
def test_copies_keep_the_contract_and_the_gradients(case, copier):
    torch.manual_seed(0)
    layer = case.make(True)
    assert any(_contract(layer)["skip"].values())
    twin = copier(layer)
    assert _contract(twin) == _contract(layer)
    assert all(p is not q for p, q in zip(twin.parameters(), layer.parameters()))
    xa, xb = inputs()
    loss_of(case, layer, xa).backward()
    loss_of(case, twin, xb).backward()
    splitgrad.backward_dw(layer)
    splitgrad.backward_dw(twin)
    a, b = param_grads(layer), param_grads(twin)
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=0, msg=name)


def test_copy_of_a_fused_layer_keeps_the_flag():
    layer = splitgrad.Linear(3, 2, fuse_wgrad_accumulation=True)
    twin = copy.deepcopy(layer)
    assert twin.weight.skip_backward_post_hook and twin.bias.skip_backward_post_hook
    assert twin.fuse_wgrad_accumulation and not twin.need_backward_dw()
    op = copy.deepcopy(ops.Linear(3, 2, accumulate_into_main_grad=True))
    assert op.weight.skip_backward_post_hook and op.accumulate_into_main_grad


def test_copy_of_an_immediate_layer_has_no_flag_set():
    twin = copy.deepcopy(splitgrad.Linear(3, 2))
    assert not twin.weight.skip_backward_post_hook  # not trivially True: the flag follows the mode


def test_copy_with_pending_work_is_refused():
    layer = splitgrad.Linear(3, 2, delay_wgrad_compute=True)
    layer(torch.randn(2, 3)).sum().backward()
    with pytest.raises(RuntimeError, match="queued=1"):
        copy.deepcopy(layer)
    layer.backward_dw()
    copy.deepcopy(layer)
