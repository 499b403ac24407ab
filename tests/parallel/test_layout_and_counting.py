"""Bucket layout and contribution counting, without processes.

Why: the DDP's correctness rests on two pure pieces — every parameter's ``main_grad`` is a distinct,
aligned view of a padded bucket, and the number of gradient contributions read from a forward's autograd
graph matches how often the hooks will really fire (tied modules twice, a plain parameter used twice once).
Checked here in milliseconds, so a regression points at the piece that broke.
"""

from __future__ import annotations

import torch
from torch import nn

import splitgrad
from splitgrad.parallel.data.buckets import ALIGN, build_buffers
from splitgrad.parallel.data.readiness import StepCounts, count_contributions


def _layout(model: nn.Module, bucket_size: int, world: int = 3):
    named = list(reversed([(n, p) for n, p in model.named_parameters()]))
    dtypes = {p.dtype: torch.float32 for _, p in named}
    return named, *build_buffers(named, bucket_size=bucket_size, grad_dtype_for=dtypes, world_size=world)


def test_layout_views_alignment_and_order():
    model = nn.Sequential(nn.Linear(5, 7), nn.Linear(7, 3), nn.Linear(3, 2, dtype=torch.float64))
    named, buffers, buckets = _layout(model, bucket_size=30)
    assert len(buffers) == 1 and buffers[0].dtype == torch.float32  # one buffer per grad dtype
    order = [n for b in buckets for n in b.names]
    assert order == [n for n, _ in named], "buckets must follow the given (backprop) order"
    seen = set()
    for bucket in buckets:
        assert bucket.numel % (ALIGN * 3) == 0, "bucket not padded to a multiple of the world size"
        for p, (lo, hi) in zip(bucket.params, bucket.param_ranges):
            assert lo % ALIGN == 0 and hi - lo == p.numel()
            assert p.main_grad.shape == p.shape and p.main_grad.dtype == torch.float32
            assert p.main_grad.data_ptr() == bucket.data[lo:hi].data_ptr()
            seen.update(range(bucket.data[lo:hi].data_ptr(), bucket.data[lo:hi].data_ptr() + 4 * p.numel()))
    assert len(seen) == 4 * sum(p.numel() for _, p in named), "main_grad views overlap"
    # Small buckets: one parameter each, never split, even when larger than bucket_size.
    _, _, buckets = _layout(nn.Linear(16, 16), bucket_size=1)
    assert [len(b.params) for b in buckets] == [1, 1]


def test_counting_tied_split_module_and_plain_reuse():
    split = splitgrad.Linear(4, 4, delay_wgrad_compute=True)
    plain = nn.Linear(4, 4)
    params = [split.weight, split.bias, plain.weight, plain.bias]
    index_of = {id(p): i for i, p in enumerate(params)}
    skip = [bool(getattr(p, "skip_backward_post_hook", False)) for p in params]
    assert skip == [True, True, False, False]
    x = torch.randn(3, 4)
    out = split(plain(split(plain(x))))  # both used twice
    counts = count_contributions({"y": [out]}, index_of, skip)
    assert counts == {0: 2, 1: 2, 2: 1, 3: 1}
    # What the hooks will really do: two wgrad tasks, one AccumulateGrad call per plain parameter.
    fired = []
    split.register_wgrad_accumulation_and_reduce_hooks(lambda: fired.append("split"))
    for p in (plain.weight, plain.bias):
        p.register_post_accumulate_grad_hook(lambda p: fired.append("plain"))
    out.sum().backward()
    splitgrad.backward_dw(split)
    assert sorted(fired) == ["plain", "plain", "split", "split"]


def test_step_counts_completion():
    counts = StepCounts(bucket_of=[0, 0, 1], n_buckets=2)
    assert not counts.complete(0), "nothing is complete before a forward was counted"
    counts.add_expected({0: 2, 1: 1})
    assert counts.complete(1), "a bucket of unused parameters is complete (reported at finish)"
    counts.arrive(0)
    counts.arrive(1)
    assert not counts.complete(0), "one of two contributions of a tied parameter must not complete it"
    counts.arrive(0)
    assert counts.complete(0)
    counts.arrive(1)  # more than predicted: the bucket waits for finish_grad_sync()
    assert not counts.complete(0)
    assert counts.unused(range(3)) == [(2, 0)]
