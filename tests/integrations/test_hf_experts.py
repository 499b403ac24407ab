"""transformers v5 MoE models after ``splitgrad.convert``: the experts defer their weight gradient and training is
unchanged, on the four families the issue names (and the layouts they stand for).

Why: the largest weight-gradient work of an MoE model is its experts'. After ``convert`` the experts of
Mixtral (concatenated gate/up), Qwen3-MoE, DeepSeek-V3 (fp32 router, shared experts) and gpt-oss (transposed
weights, biases, interleaved clamped swiglu) must be split-capable — found by the whole-model helpers, one task
and one hook per backward, seen by the optimizer guard — while logits, loss and every gradient stay those of
the unconverted model: float64 against transformers' eager experts (loop path), float32 against its own
``grouped_mm`` path (grouped_mm runs in both).
"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

import splitgrad
from splitgrad.integrations.transformers import SplitExperts
from tests.helpers import attach_main_grad, grads

from . import hf_tiny

FAMILIES = ["mixtral", "qwen3_moe", "deepseek_v3", "gpt_oss"]
F64 = {"rtol": 1e-9, "atol": 1e-11}
F32 = {"rtol": 2e-5, "atol": 2e-6}
EXACT = {"rtol": 0, "atol": 0}


def experts(model) -> list[tuple[str, SplitExperts]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, SplitExperts)]


def step(model, seed: int = 0, *, drain: bool):
    out = model(input_ids=hf_tiny.batch(seed), labels=hf_tiny.batch(seed))
    out.loss.backward()
    if drain:
        splitgrad.backward_dw(model)
    return out.logits.detach(), out.loss.detach()


def assert_same_training(got, want, model, reference, tol, what):
    torch.testing.assert_close(got[0], want[0], **tol, msg=lambda m: f"{what} logits: {m}")
    torch.testing.assert_close(got[1], want[1], **tol, msg=lambda m: f"{what} loss: {m}")
    mine, theirs = grads(model), grads(reference)
    assert mine.keys() == theirs.keys()
    for name, g in mine.items():
        assert g is not None and theirs[name] is not None, f"{what}: {name} has no gradient"
        torch.testing.assert_close(g, theirs[name], **tol, msg=lambda m, n=name: f"{what} {n}: {m}")


@pytest.mark.parametrize(
    ("dtype", "tol"), [(torch.float64, F64), (torch.float32, F32)], ids=["float64-loop", "float32-grouped_mm"]
)
@pytest.mark.parametrize("family", FAMILIES)
def test_converted_model_trains_like_the_original(family, dtype, tol):
    reference = hf_tiny.model(family, dtype)
    model = splitgrad.convert(copy.deepcopy(reference))
    names = [n for n, _ in experts(model)]
    assert names and all(m.need_backward_dw() for _, m in experts(model))
    assert [n for n, _ in splitgrad.split_modules(model) if n in names] == names
    want = step(reference, drain=False)
    out = model(input_ids=hf_tiny.batch(), labels=hf_tiny.batch())
    out.loss.backward()
    for name, m in experts(model):  # deferred: nothing written yet, one task each
        assert all(p.grad is None for p in m.get_backward_dw_params()), name
        assert m.wgrad_store.outstanding.queued == 1, name
    assert splitgrad.pending_wgrad(model) >= len(names)
    splitgrad.backward_dw(model)
    assert_same_training((out.logits.detach(), out.loss.detach()), want, model, reference, tol, family)
    if dtype != torch.float64:
        return
    # Negative check (once per family): the comparison rejects a model whose experts 0 and 1 are swapped.
    broken = splitgrad.convert(copy.deepcopy(reference))
    w = experts(broken)[0][1].down_proj
    with torch.no_grad():
        w[[0, 1]] = w[[1, 0]].clone()
    got = step(broken, drain=True)
    with pytest.raises(AssertionError):
        assert_same_training(got, want, broken, reference, tol, family)


# float32 (grouped_mm) for every family; the float64 loop for one standard and the transposed layout.
@pytest.mark.parametrize(
    ("family", "dtype"),
    [(f, torch.float32) for f in FAMILIES] + [("mixtral", torch.float64), ("gpt_oss", torch.float64)],
    ids=str,
)
def test_delayed_is_bitwise_immediate(family, dtype):
    immediate = splitgrad.convert(hf_tiny.model(family, dtype), delay_wgrad_compute=False)
    delayed = splitgrad.convert(hf_tiny.model(family, dtype))
    for seed in (0, 1):  # two backwards: the second accumulates
        want = step(immediate, seed, drain=False)
        assert splitgrad.pending_wgrad(immediate) == 0
        got = step(delayed, seed, drain=True)
        assert_same_training(got, want, delayed, immediate, EXACT, f"{family} delayed vs immediate")


@pytest.mark.parametrize("family", ["mixtral", "gpt_oss"])
def test_three_adamw_steps_match_the_original(family):
    reference = hf_tiny.model(family)
    model = splitgrad.convert(copy.deepcopy(reference))
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (reference, model)]
    splitgrad.guard_optimizer(opts[1], model)
    for seed in range(3):
        for m, opt, drain in ((reference, opts[0], False), (model, opts[1], True)):
            step(m, seed, drain=drain)
            opt.step()
            opt.zero_grad()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(
            p, q, **F64, msg=lambda m, n=name: f"{family} after 3 AdamW steps, {n}: {m}"
        )


@pytest.mark.parametrize("family", FAMILIES)
def test_hooks_fire_once_per_task_and_the_guard_sees_the_experts(family):
    model = splitgrad.convert(hf_tiny.model(family))
    fired = {n: 0 for n, _ in experts(model)}
    for name, m in experts(model):
        m.register_wgrad_accumulation_and_reduce_hooks(lambda n=name: fired.__setitem__(n, fired[n] + 1))
        assert all(p.skip_backward_post_hook for p in m.get_backward_dw_params())
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    splitgrad.guard_optimizer(opt, model)
    out = model(input_ids=hf_tiny.batch(), labels=hf_tiny.batch())
    out.loss.backward()
    assert set(fired.values()) == {0}
    first = next(iter(fired))
    with pytest.raises(RuntimeError, match=rf"pending.*{first}"):
        opt.step()
    splitgrad.backward_dw(model)
    assert set(fired.values()) == {1}, fired
    opt.step()
    splitgrad.ensure_no_pending_wgrad(model)


@pytest.mark.parametrize("family", ["mixtral", "gpt_oss"])
def test_fused_main_grad_of_3d_expert_weights(family):
    reference = hf_tiny.model(family)
    model = splitgrad.convert(
        copy.deepcopy(reference), delay_wgrad_compute=False, fuse_wgrad_accumulation=True
    )
    buffers = attach_main_grad(model, fill=0.0)
    assert any(p.dim() == 3 for p in buffers)
    step(reference, drain=False)
    step(model, drain=False)
    ref = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        if hasattr(p, "main_grad"):
            assert p.grad is None, name
            torch.testing.assert_close(p.main_grad, ref[name].grad, **F64, msg=lambda m, n=name: f"{n}: {m}")


def test_same_parameters_names_state_dict_and_class_identity():
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    model = hf_tiny.model("mixtral")
    params = dict(model.named_parameters())
    keys = list(model.state_dict())
    opt = torch.optim.AdamW(model.parameters())
    ids = [id(m) for m in model.modules()]
    splitgrad.convert(model)
    assert dict(model.named_parameters()) == params and list(model.state_dict()) == keys
    converted = experts(model)
    assert all(isinstance(m, MixtralExperts) and id(m) in ids for _, m in converted)
    assert type(converted[0][1]).__name__ == "SplitMixtralExperts"
    assert model.model.layers[0].mlp.gate.weight.grad is None and "gate" not in [n for n, _ in converted]
    step(model, drain=True)
    opt.step()  # the optimizer built before convert updates the experts
    # deepcopy and pickle rebuild the run-time class from the importable HF class
    clone = pickle.loads(pickle.dumps(copy.deepcopy(model)))
    assert type(experts(clone)[0][1]) is type(converted[0][1])
    assert all(p.skip_backward_post_hook for p in experts(clone)[0][1].get_backward_dw_params())
    # converting twice changes nothing
    splitgrad.convert(model)
    assert [type(m) for _, m in experts(model)] == [type(m) for _, m in converted]


def test_expert_parallel_sentinel_ids_contribute_zero():
    model = splitgrad.convert(hf_tiny.model("mixtral"))
    layer = experts(model)[0][1]
    h = torch.randn(6, 64, dtype=torch.float64)
    ids = torch.tensor([[0, 8], [3, 1], [8, 8], [2, 5], [7, 0], [4, 8]])  # 8 = num_experts: not local
    w = torch.rand(6, 2, dtype=torch.float64)
    got = layer(h, ids, w)
    keep = ids < 8
    want = layer(h, torch.where(keep, ids, 0), torch.where(keep, w, 0.0))
    torch.testing.assert_close(got, want, **F64)
    assert torch.equal(got[2], torch.zeros(64, dtype=torch.float64))
    splitgrad.discard_wgrad(model)
