"""Expert parallelism is exact: EP = 2 and 3 on gloo against the single-process MoEGPT on the global batch.

Why: the expert-parallel layer moves token copies between ranks (split sizes first, then a variable-split
all-to-all), regroups them per local expert and moves the outputs back; the aux loss needs global counts. Any
mistake in the permutations, the splits, the backward exchange or the loss weighting shows up as a gradient
that differs from the reference, so every loss, block-input gradient and parameter gradient (experts, router,
dense) is compared in float64, in immediate and delayed modes (delayed bitwise equal to immediate), for
module-based and ops-based experts, with experts that receive no token, and with the benchmarks' forced-balance
routing. Each case also runs two microbatches through ``overlapped_forward_backward`` (one thread, one group):
bitwise as in order.
"""

from __future__ import annotations

import pytest

from splitgrad.testing import spawn
from tests.expert import ep_checks

pytestmark = pytest.mark.distributed

CASES_2 = [
    ({}, 2, 8, "module"),
    ({"top_k": 1, "activation": "swiglu", "bias": False, "norm_topk_prob": True}, 2, 8, "ops"),
    # 2 x 3 tokens over 8 experts, top-1: most experts get no token.
    # The benchmarks' forced balance: 2 x 8 tokens x top-2 per rank divides by 4 experts.
    ({"router_force_load_balancing": True}, 2, 8, "module"),
    ({"num_experts": 8, "top_k": 1}, 1, 3, "module"),
]
CASES_3 = [
    ({"num_experts": 6}, 1, 8, "module"),
    ({"num_experts": 6, "top_k": 1, "normalization": "RMSNorm"}, 1, 2, "ops"),
]


@pytest.mark.parametrize("world, cases", [(2, CASES_2), (3, CASES_3)], ids=["ep2", "ep3"])
def test_expert_parallel_matches_single_process(world, cases):
    reports = spawn(ep_checks.exactness, world, cases, timeout=240.0, pg_timeout=120.0)
    # The idle-expert cases really had experts without tokens.
    assert reports[0][-1]["idle_experts"] > 0
    if world == 2:  # the forced-balance case: every expert got the same global count (2 ranks x 32 / 4)
        assert reports[0][2]["per_expert"] == [[16, 16, 16, 16]] * 2
    # The negative check (a wrong expert's gradient is rejected) ran on every rank.
    assert all(any(case["negative"] for case in report) for report in reports)


def test_ep_size_must_divide_num_experts():
    messages = spawn(ep_checks.bad_ep_size, 3, timeout=120.0)
    assert all("num_experts=4" in m and "ep_size=3" in m for m in messages)


def test_hook_driven_reduction_ep2_x_expert_dp2():
    """4 ranks: EP = 2 x expert-DP = 2 (dense DP = 4); buckets started by the wgrad hooks, grads exact.

    The same spawn then runs two microbatches through ExpertDataParallel in the overlapped order
    (``F0 (F1 || B0) B1 W``, expert W inside the dispatch all-to-all): gradients equal the reference and,
    bitwise, the in-order run; each bucket starts once, from a hook of the last microbatch, though the pair's
    backward fires hooks between the forward's steps.
    """
    cases = [
        ({}, 1, 8, "module", "immediate"),
        ({}, 1, 8, "module", "delayed"),
        ({"bias": False}, 1, 8, "ops", "fused"),
        ({"num_experts": 8, "top_k": 1}, 1, 4, "ops", "delayed"),
    ]
    reports = spawn(ep_checks.hook_reduction, 4, 2, cases, ("module",), timeout=300.0, pg_timeout=150.0)
    assert [case["mode"] for case in reports[0]] == [
        "immediate",
        "delayed",
        "fused",
        "delayed",
        "overlapped/module",
    ]
    for report in reports:
        overlapped = report[-1]
        assert overlapped["negative"] and overlapped["bare_model_refused"]
        assert overlapped[True]["buckets"] == overlapped[False]["buckets"] >= 4
        # The pair's backward really fired wgrad hooks (expert W inside the dispatch all-to-all), on this thread.
        assert overlapped[True]["hook_threads"] == ["MainThread"]


def test_overlapped_forward_backward_is_bitwise_sequential():
    """Batch-level overlap (F of microbatch 1 while B of microbatch 0 runs, one thread stepping the forward at each
    backward exchange, one group) trains bit-for-bit like in order.

    With delayed wgrad the expert W of microbatch 0 runs inside each layer's backward dispatch all-to-all
    (checked by the order of the logged events), the dense W stays deferred, nothing is left owed, and every
    expert module's wgrad hooks fire exactly once per microbatch.
    """
    modes = [("immediate", "module"), ("delayed", "module"), ("delayed", "ops")]
    reports = spawn(ep_checks.overlap_bitwise, 2, modes, timeout=240.0, pg_timeout=120.0)
    for report in reports:
        assert report[:3] == ["immediate/module", "delayed/module", "delayed/ops"]
        assert report[3] == "errors named"
