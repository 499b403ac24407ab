"""Exact resume: a run checkpointed after step K and resumed continues bitwise like the uninterrupted run.

Why: a job that resumes almost where it stopped silently trains another model. The matrix below covers the
schedules (1f1b, zb-h1, zbv, dualpipev), pipeline x data parallelism, pipeline x expert parallelism, a
checkpoint of zbv (2 ranks, 4 stages in a V) resumed by 1f1b on 4 ranks, and a pp2 x dp2 checkpoint loaded
by pp2 x dp1. Bitwise is asserted where it holds by construction: the same schedule, or schedules that add
every stage's microbatch gradients in the same order (``same_gradient_order``), run the same operations on the
same operands after the restore. Everything runs in one 4-rank spawn (``resume_checks.resume_matrix``).
"""

from __future__ import annotations

import pytest
import torch

from splitgrad.pipeline import build_schedule
from splitgrad.pipeline.checkpoint import same_gradient_order
from splitgrad.testing import spawn
from tests.checkpoint import resume_checks
from tests.checkpoint.resume_checks import STEPS, K

pytestmark = pytest.mark.distributed

MATRIX = ["1f1b", "zb-h1", "zbv", "dualpipev", "1f1b-ddp", "zbv-ddp", "1f1b-ep"]
HALF_ONLY = {"1f1b": 0, "zbv": 0, "zb-h1": 2, "dualpipev": 2}  # which pipeline ran it in phase 1


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume")
    return spawn(resume_checks.resume_matrix, 4, str(root), timeout=400, pg_timeout=120)


def _ranks(label: str) -> list[int]:
    first = HALF_ONLY.get(label)
    return [0, 1, 2, 3] if first is None else [first, first + 1]


@pytest.mark.parametrize("label", MATRIX)
def test_resumed_losses_are_bitwise_the_uninterrupted_ones(reports, label):
    for rank in _ranks(label):
        run = reports[rank][label]
        before, after = run["uninterrupted"]["losses"], run["resumed"]["losses"]
        assert sorted(after) == list(range(K + 1, STEPS + 1)), after
        assert run["resumed"]["restored_step"] == K
        assert run["resumed"]["rng_restored"], "same layout: the generators must be restored"
        assert {s: before[s] for s in after} == after, f"rank {rank}: {before} vs {after}"


def test_the_comparison_can_fail(reports):
    # Not trivially passing: 1f1b here has dropout, so resuming without the saved generators differs.
    for rank in (0, 1):
        before = reports[rank]["1f1b"]["uninterrupted"]["losses"]
        without = reports[rank]["1f1b-no-rng"]
        assert not without["rng_restored"]
        assert all(without["losses"][s] != before[s] for s in without["losses"]), (before, without)


def _by_name(reports, ranks, label, which) -> dict:
    merged = {"params": {}, "optim": {}}
    for rank in ranks:
        state = (
            reports[rank][label][which] if which == "loaded" else reports[rank][label]["uninterrupted"][which]
        )
        for part in merged:
            merged[part].update(state[part])
    return merged


def _assert_same_state(a: dict, b: dict) -> None:
    assert a["params"].keys() == b["params"].keys() and a["optim"].keys() == b["optim"].keys()
    for name, tensor in a["params"].items():
        torch.testing.assert_close(
            b["params"][name], tensor, rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}"
        )
    for name, state in a["optim"].items():
        assert state.keys() == b["optim"][name].keys()
        for key, tensor in state.items():
            torch.testing.assert_close(b["optim"][name][key], tensor, rtol=0, atol=0)
            assert b["optim"][name][key].dtype == tensor.dtype  # AdamW's step stays a float32 tensor


def test_zbv_checkpoint_resumes_under_1f1b_on_four_ranks(reports):
    # The V placement (rank 0: stages 0 and 3) restored one stage per rank: weights and AdamW state bitwise.
    saved = _by_name(reports, [0, 1], "zbv", "saved")
    loaded = {"params": {}, "optim": {}}
    for rank in range(4):
        for part in loaded:
            loaded[part].update(reports[rank]["zbv->1f1b"]["loaded"][part])
    _assert_same_state(saved, loaded)
    # zbv and 1f1b add every stage's microbatch gradients in increasing order: the same arithmetic.
    assert same_gradient_order(build_schedule("zbv", 4, 4), build_schedule("1f1b", 4, 4))
    before = reports[0]["zbv"]["uninterrupted"]["losses"]
    for rank in range(4):
        resumed = reports[rank]["zbv->1f1b"]
        assert not resumed["rng_restored"]  # another layout: no rank's stream has a saved counterpart
        assert resumed["losses"] == {s: before[s] for s in range(K + 1, STEPS + 1)}


def test_data_parallel_checkpoint_loads_under_another_dp_size(reports):
    saved = _by_name(reports, [0, 1], "1f1b-ddp", "saved")
    loaded = {"params": {}, "optim": {}}
    for rank in (0, 1):
        for part in loaded:
            loaded[part].update(reports[rank]["dp2->dp1"]["loaded"][part])
    _assert_same_state(saved, loaded)


def test_a_checkpoint_of_another_partition_is_refused_naming_both(reports):
    for rank in (0, 1):
        message = reports[rank]["partition_error"]
        assert (
            "cut into 4 stages as [stage 0: embed, blocks.0 | stage 1: blocks.1 | stage 2: blocks.2 | "
            "stage 3: blocks.3, head]" in message
        ), message
        assert "cut into 2 as [stage 0: embed, blocks.0-1 | stage 1: blocks.2-3, head]" in message, message
