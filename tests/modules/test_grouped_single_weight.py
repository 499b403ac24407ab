"""GroupedLinear with one 3-D weight (TE's ``single_grouped_weight``): the grouped GEMM's two paths, the fused
``main_grad`` promise, empty groups, meta device and checkpoints in either layout.

Why: the ecosystem stores experts as one ``(experts, out, in)`` parameter, and torch's ``grouped_mm`` only
runs for some dtypes and strides. The loop and ``grouped_mm`` must agree on the same inputs, fused
accumulation must not allocate the weight-sized gradient ``grouped_mm`` would, and a checkpoint must move
between the layouts without changing a single value. The contract clauses themselves run in
``tests/conformance`` on both layouts.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import splitgrad
from splitgrad import ops
from splitgrad.functional import grouped_gemm as gg
from splitgrad.functional.grouped_layout import convert_grouped_state_dict
from splitgrad.testing.memory import AllocationTracker
from tests.helpers import attach_main_grad

SPLITS = [5, 0, 7, 4]
FP32 = {"rtol": 1.3e-6, "atol": 1e-5}
EXACT = {"rtol": 0, "atol": 0}


def _operands(dtype=torch.float32, transposed=False, out=48, inp=32):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(sum(SPLITS), inp, generator=gen).to(dtype)
    w = torch.randn(len(SPLITS), out, inp, generator=gen).to(dtype)
    b = torch.randn(len(SPLITS), out, generator=gen).to(dtype)
    dy = torch.randn(sum(SPLITS), out, generator=gen).to(dtype)
    return x, (w.transpose(1, 2).contiguous() if transposed else w), b, dy


@pytest.mark.parametrize("transposed", [False, True], ids=["out-in", "in-out"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_grouped_mm_and_loop_agree_on_the_same_inputs(dtype, transposed):
    x, w, b, dy = _operands(dtype, transposed)
    assert gg.choose_path("auto", x, w) == "grouped_mm"
    got = {}
    for path in ("loop", "grouped_mm"):
        got[path] = (
            gg.grouped_forward(x, w, SPLITS, bias=b, transposed=transposed, path=path),
            gg.grouped_dgrad(dy, w, SPLITS, transposed=transposed, path=path),
            gg.grouped_wgrad(dy, x, SPLITS, transposed=transposed, path=path),
        )
    # Float-tight, not bitwise: on CUDA grouped_mm is another kernel, and with a bias the loop uses addmm.
    tol = FP32 if dtype == torch.float32 else {"rtol": 1.6e-2, "atol": 5e-2}
    for name, a, c in zip(("y", "dx", "dW"), got["loop"], got["grouped_mm"]):
        torch.testing.assert_close(a, c, **tol, msg=lambda m, n=name: f"{n}: {m}")
    # Both against float64 per-group products.
    x64, w64, b64, dy64 = (t.double() for t in (x, w, b, dy))
    wg = w64 if transposed else w64.transpose(1, 2)
    rows = list(zip(x64.split(SPLITS), dy64.split(SPLITS)))
    want_y = torch.cat([xg @ wg[g] + b64[g] for g, (xg, _) in enumerate(rows)])
    want_dw = torch.stack([(xg.t() @ dyg) if transposed else (dyg.t() @ xg) for xg, dyg in rows])
    tol64 = {"rtol": 1e-5, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 3e-2, "atol": 0.3}
    torch.testing.assert_close(got["grouped_mm"][0].double(), want_y, **tol64)
    torch.testing.assert_close(got["grouped_mm"][2].double(), want_dw, **tol64)
    assert torch.equal(got["grouped_mm"][2][1], torch.zeros_like(got["grouped_mm"][2][1]))  # empty group


@pytest.mark.parametrize(
    ("make", "why"),
    [
        (lambda: _operands(torch.float64)[:2], "float64"),
        (lambda: (torch.randn(16, 30), torch.randn(4, 8, 30)), "not a multiple of 16 bytes"),
        (lambda: (torch.randn(1, 32).expand(16, 32), torch.randn(4, 8, 32)), "stride 0"),
        (lambda: (torch.randn(16, 32, device="meta"), torch.randn(4, 8, 32, device="meta")), "meta"),
    ],
    ids=["float64", "odd-features", "broadcast", "meta"],
)
def test_auto_takes_the_loop_where_grouped_mm_cannot_run(make, why):
    x, w = make()
    assert why in gg.grouped_mm_refusal(x, w.transpose(1, 2))
    assert gg.choose_path("auto", x, w.transpose(1, 2)) == "loop"
    with pytest.raises(ValueError, match="path='grouped_mm' cannot run here"):
        gg.choose_path("grouped_mm", x, w.transpose(1, 2))
    assert gg.choose_path("auto", separate=True) == "loop"


def test_module_float32_runs_grouped_mm_and_matches_float64(monkeypatch):
    calls = []
    real = gg._grouped_mm_op()
    monkeypatch.setattr(gg, "_grouped_mm_op", lambda: lambda *a, **k: calls.append(1) or real(*a, **k))
    layer = splitgrad.GroupedLinear(4, 32, 48, single_grouped_weight=True, single_grouped_bias=True)
    ref = splitgrad.GroupedLinear(4, 32, 48, single_grouped_weight=True, single_grouped_bias=True).double()
    ref.load_state_dict(layer.state_dict())
    x = torch.randn(16, 32, requires_grad=True)
    x64 = x.detach().double().requires_grad_()
    layer(x, SPLITS).square().sum().backward()
    assert len(calls) == 3  # forward, dgrad, wgrad
    ref(x64, SPLITS).square().sum().backward()
    for p, q in zip(layer.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad.double(), q.grad, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("layer_kind", ["module", "op"])
def test_fused_main_grad_allocates_nothing_weight_sized(layer_kind):
    """grouped_mm has no out=: the fused path must add group by group into main_grad, never allocate dW."""
    for fused in (True, False):
        if layer_kind == "module":
            layer = splitgrad.GroupedLinear(
                4, 64, 64, single_grouped_weight=True, delay_wgrad_compute=True, fuse_wgrad_accumulation=fused
            )
        else:
            layer = ops.GroupedLinear(
                4,
                64,
                64,
                single_grouped_weight=True,
                delay_wgrad_compute=True,
                accumulate_into_main_grad=fused,
            )
        attach_main_grad(layer, fill=0.0)
        assert layer.weight.main_grad.shape == (4, 64, 64)
        layer(torch.randn(16, 64), SPLITS).sum().backward()
        one_expert = 64 * 64 * 4
        with AllocationTracker() as tracker:
            layer.backward_dw()
        if fused:
            assert tracker.largest_bytes < one_expert, tracker.allocations
            assert layer.weight.grad is None and layer.weight.main_grad.abs().sum() > 0
        else:  # negative check: the unfused path allocates the whole (4, 64, 64) gradient, and the tracker sees it
            assert tracker.largest_bytes >= 4 * one_expert, tracker.allocations


@pytest.mark.parametrize("overwrite", [False, True])
def test_fused_empty_groups_accumulate_zeros_or_overwrite(overwrite):
    layer = splitgrad.GroupedLinear(
        4, 8, 8, single_grouped_weight=True, fuse_wgrad_accumulation=True, params_dtype=torch.float64
    )
    attach_main_grad(layer, fill=3.0)
    layer.weight.overwrite_main_grad = overwrite
    x = torch.randn(10, 8, dtype=torch.float64)
    layer(x, [0, 4, 0, 6]).sum().backward()
    dy = torch.ones(10, 8, dtype=torch.float64)
    want = torch.stack([torch.zeros(8, 8), dy[:4].t() @ x[:4], torch.zeros(8, 8), dy[4:].t() @ x[4:]])
    base = 0.0 if overwrite else 3.0
    torch.testing.assert_close(layer.weight.main_grad, want.double() + base, rtol=1e-12, atol=1e-12)
    assert layer.bias0.grad is not None and layer.weight.grad is None


def test_one_seed_gives_both_layouts_the_same_values_and_outputs():
    torch.manual_seed(3)
    separate = splitgrad.GroupedLinear(3, 8, 5, params_dtype=torch.float64)
    torch.manual_seed(3)
    single = splitgrad.GroupedLinear(
        3, 8, 5, single_grouped_weight=True, single_grouped_bias=True, params_dtype=torch.float64
    )
    for g in range(3):
        assert torch.equal(single.weight[g], separate.get_parameter(f"weight{g}"))
        assert torch.equal(single.bias[g], separate.get_parameter(f"bias{g}"))
    x = torch.randn(10, 8, dtype=torch.float64)
    torch.testing.assert_close(single(x, [3, 5, 2]), separate(x, [3, 5, 2]), **EXACT)  # both loop in float64


@pytest.mark.parametrize("to_single", [True, False])
@pytest.mark.parametrize("cls", ["module", "op"])
def test_state_dict_converts_both_ways(to_single, cls):
    def make(single: bool):
        if cls == "module":
            return splitgrad.GroupedLinear(3, 8, 5, single_grouped_weight=single, single_grouped_bias=single)
        return ops.GroupedLinear(3, 8, 5, single_grouped_weight=single, single_grouped_bias=single)

    source, target = make(not to_single), make(to_single)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), source)
    sd = convert_grouped_state_dict(model.state_dict(), 3, single_grouped_weight=to_single, prefix="1.")
    assert list(sd)[:2] == ["0.weight", "0.bias"]
    target.load_state_dict({k[2:]: v for k, v in sd.items() if k.startswith("1.")})
    x = torch.randn(10, 8)
    torch.testing.assert_close(target(x, [3, 5, 2]), source(x, [3, 5, 2]), **FP32)
    back = convert_grouped_state_dict(target.state_dict(), 3, single_grouped_weight=not to_single)
    assert sorted(back) == sorted(source.state_dict())  # weights, then biases: load_state_dict ignores order
    for k, v in source.state_dict().items():
        assert torch.equal(back[k], v), k


def test_state_dict_conversion_errors_name_the_problem():
    sd = splitgrad.GroupedLinear(3, 8, 5).state_dict()
    with pytest.raises(ValueError, match=r"no 'x.weight' nor 'x.weight0'"):
        convert_grouped_state_dict(sd, 3, single_grouped_weight=True, prefix="x.")
    with pytest.raises(ValueError, match="1 of 4 entries missing"):
        convert_grouped_state_dict(sd, 4, single_grouped_weight=True)
    single = splitgrad.GroupedLinear(3, 8, 5, single_grouped_weight=True).state_dict()
    with pytest.raises(ValueError, match=r"not 2 groups"):
        convert_grouped_state_dict(single, 2, single_grouped_weight=False)


@pytest.mark.parametrize("cls", ["module", "op"])
def test_meta_device_materialises_like_the_cpu_layer(cls):
    def make(device):
        if cls == "module":
            return splitgrad.GroupedLinear(
                3, 8, 8, single_grouped_weight=True, single_grouped_bias=True, delay_wgrad_compute=True,
                params_dtype=torch.float64, device=device,
            )  # fmt: skip
        return ops.GroupedLinear(
            3, 8, 8, single_grouped_weight=True, single_grouped_bias=True, delay_wgrad_compute=True,
            dtype=torch.float64, device=device,
        )  # fmt: skip

    meta = make("meta")
    assert meta(torch.empty(2, 5, 8, device="meta", dtype=torch.float64), [4, 0, 6]).shape == (2, 5, 8)
    meta.to_empty(device="cpu")
    torch.manual_seed(5)
    meta.reset_parameters()
    assert meta.weight.skip_backward_post_hook and meta.bias.skip_backward_post_hook
    torch.manual_seed(5)
    cpu = make(None)
    for p, q in zip(meta.parameters(), cpu.parameters()):
        assert torch.equal(p, q)
    x = torch.randn(10, 8, dtype=torch.float64)
    meta(x, [4, 0, 6]).sum().backward()
    meta.backward_dw()
    w = meta.weight.detach().clone().requires_grad_()
    (F.linear(x[:4], w[0]).sum() + F.linear(x[4:], w[2]).sum()).backward()
    torch.testing.assert_close(meta.weight.grad, w.grad, rtol=1e-12, atol=1e-12)
    assert torch.equal(meta.weight.grad[1], torch.zeros(8, 8, dtype=torch.float64))  # the empty group
    # Negative check: group 2's gradient is not group 0's.
    assert not torch.allclose(meta.weight.grad[0], w.grad[2])


def test_parameter_names_follow_te():
    names = lambda m: [n for n, _ in m.named_parameters()]  # noqa: E731
    assert names(splitgrad.GroupedLinear(2, 8, 5, single_grouped_weight=True)) == ["weight", "bias0", "bias1"]
    assert names(splitgrad.GroupedLinear(2, 8, 5, single_grouped_bias=True)) == ["weight0", "weight1", "bias"]
    both = splitgrad.GroupedLinear(2, 8, 5, single_grouped_weight=True, single_grouped_bias=True)
    assert [(n, tuple(p.shape)) for n, p in both.named_parameters()] == [
        ("weight", (2, 5, 8)),
        ("bias", (2, 5)),
    ]
    assert names(splitgrad.GroupedLinear(2, 8, 5, bias=False, single_grouped_weight=True)) == ["weight"]
    assert names(ops.GroupedLinear(2, 8, 5, single_grouped_weight=True)) == ["weight", "bias0", "bias1"]
