"""Bad ``m_splits`` / ``split_sizes`` and misplaced inputs get a clear error from both GroupedLinear APIs.

Why: ``int(2.7)`` used to truncate fractional sizes silently and 2-D sizes died with a ``TypeError`` from
inside; a grouped GEMM on the wrong rows computes plausible garbage. Sizes must be integers (an integral
float such as ``2.0`` is refused too: float sizes almost always come from a router's fractions), one per
group, non-negative, summing to the rows; the error shows the values. An input on another device than the
weights names the module and both devices.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import splitgrad
from splitgrad import ops

BAD_SPLITS = {
    "integral-floats": ([4.0, 6.0], r"element 0 is float 4\.0"),
    "fractional-floats": ([4.5, 5.5], r"element 0 is float 4\.5"),
    "bools": ([True, 9], r"element 0 is bool True"),
    "nested": ([[4, 6]], r"element 0 is list \[4, 6\]"),
    "2-d-tensor": (torch.tensor([[4, 6]]), r"1-D with an integer dtype.*shape=\(1, 2\): \[\[4, 6\]\]"),
    "float-tensor": (torch.tensor([4.0, 6.0]), r"dtype=torch\.float32.*\[4\.0, 6\.0\]"),
    "bool-tensor": (torch.tensor([True, False]), r"dtype=torch\.bool"),
    "not-a-sequence": (10, r"sequence of ints or a 1-D integer tensor, got int 10"),
    "too-few": ([10], r"2 non-negative ints summing to the 10 input rows, got \w+=\[10\] \(len=1"),
    "negative": ([11, -1], r"got \w+=\[11, -1\]"),
    "wrong-sum": ([4, 5], r"got \w+=\[4, 5\] \(len=2, sum=9\)"),
}


def _layers():
    torch.manual_seed(0)
    return {
        "module": splitgrad.GroupedLinear(2, 3, 4),
        "op": ops.GroupedLinear(2, 3, 4),
    }


@pytest.mark.parametrize("api", ["module", "op"])
@pytest.mark.parametrize("bad", list(BAD_SPLITS), ids=str)
def test_bad_split_sizes_raise_value_error_showing_them(api, bad):
    layer = _layers()[api]
    sizes, pattern = BAD_SPLITS[bad]
    arg = "m_splits" if api == "module" else "split_sizes"
    with pytest.raises(ValueError, match=pattern) as info:
        layer(torch.randn(10, 3), sizes)
    assert "GroupedLinear(" in str(info.value) and f"{arg} " in str(info.value)


@pytest.mark.parametrize("api", ["module", "op"])
def test_integer_sizes_of_every_kind_are_accepted_and_exact(api):
    """Python ints, numpy integers and integer tensors (any int dtype) give the same bits as plain F.linear."""
    layer = _layers()[api].double()
    x = torch.randn(10, 3, dtype=torch.float64)
    p = dict(layer.named_parameters())
    want = torch.cat([F.linear(xi, p[f"weight{g}"], p[f"bias{g}"]) for g, xi in enumerate(x.split([4, 6]))])
    for sizes in ([4, 6], (4, 6), [np.int64(4), np.int32(6)], np.array([4, 6]), torch.tensor([4, 6]),
                  torch.tensor([4, 6], dtype=torch.int32), [torch.tensor(4), torch.tensor(6)]):  # fmt: skip
        torch.testing.assert_close(layer(x, sizes), want, rtol=0, atol=0)
    with pytest.raises(AssertionError):  # not trivially passing: other rows per group give other results
        torch.testing.assert_close(layer(x, [6, 4]), want, rtol=0, atol=0)


@pytest.mark.parametrize("api", ["module", "op"])
def test_input_on_another_device_names_both_devices(api):
    layer = _layers()[api]
    with pytest.raises(
        RuntimeError, match=r"GroupedLinear\(.*input is on device meta but weight0 is on device cpu"
    ):
        layer(torch.empty(10, 3, device="meta"), [4, 6])


@pytest.mark.parametrize(
    "make",
    [
        lambda: splitgrad.Linear(3, 4),
        lambda: splitgrad.LayerNormLinear(3, 4),
        lambda: splitgrad.LayerNormMLP(3, 8),
    ],
    ids=["Linear", "LayerNormLinear", "LayerNormMLP"],
)
def test_every_module_names_both_devices(make):
    module = make()
    with pytest.raises(
        RuntimeError, match=rf"{type(module).__name__}\(.*device meta but \w+ is on device cpu"
    ):
        module(torch.empty(5, 3, device="meta"))


def test_meta_tensor_sizes_are_refused_clearly():
    layer = splitgrad.GroupedLinear(2, 3, 4, device="meta")
    with pytest.raises(ValueError, match="meta device has no values; pass a list"):
        layer(torch.empty(10, 3, device="meta"), torch.empty(2, dtype=torch.int64, device="meta"))
