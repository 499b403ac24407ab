"""The pipeline runtime on real gloo ranks gives the single-process float64 loss and gradients.

Why: the runtime moves activations and input gradients between processes and runs each microbatch's deferred
weight-gradient work in whatever order a schedule says; any mix-up (wrong microbatch, lost or doubled W,
a gradient of the wrong stage, a bucket reduced before its last W) shows up as a gradient mismatch. One spawn
per world size batches every schedule, so the whole file costs two process launches.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from splitgrad.pipeline import build_schedule
from splitgrad.pipeline.ir.validate import channel_order_problems
from splitgrad.testing import spawn

from . import workers

pytestmark = [pytest.mark.distributed, pytest.mark.filterwarnings("ignore::UserWarning")]


def _assert_check(label: str, out: dict, *, split: bool) -> None:
    assert out["checked"] > 0, f"{label}: no parameter compared"
    assert not out["bad"], f"{label}: gradients differ from the float64 reference: {out['bad'][:5]}"
    assert out["loss"] == pytest.approx(out["ref_loss"], rel=1e-12, abs=1e-12), label
    if split:
        assert out["w_tasks"] > 0, f"{label}: W actions ran no deferred work"
    else:
        assert out["w_tasks"] == 0, f"{label}: a schedule without W ran deferred work in W"


@pytest.fixture(scope="module")
def two_rank_results():
    out_dir = workers.scratch_dir()
    try:
        yield spawn(workers.two_rank_worker, 2, out_dir, timeout=300), out_dir
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def four_rank_results():
    return spawn(workers.four_rank_worker, 4, timeout=400)


@pytest.mark.parametrize("name", [n for n, _ in workers.SCHEDULES])
def test_every_schedule_two_ranks(two_rank_results, name):
    results, _ = two_rank_results
    for rank, res in enumerate(results):
        _assert_check(f"{name} rank {rank}", res[name], split=name in workers.SPLIT)


def test_every_family_bitwise_equal_to_1f1b(two_rank_results):
    """Same blocks, same microbatches: every family, dualpipev's overlapped F+B pairs (through the stages'
    ``overlapped_forward_backward`` hook and run in order) gives 1f1b's gradients bit for bit, and both match
    the float64 plain-autograd reference. Each runs two steps: the shapes are agreed on the first, and the
    second (no header, every receive posted ahead) gives the same gradients bit for bit."""
    results, _ = two_rank_results
    runs: dict[str, dict] = {}
    for res in results:
        for label, run in res["bitwise"].items():
            merged = runs.setdefault(label, {"grads": {}, "loss": run["loss"], "calls": 0, "fb": 0})
            merged["grads"].update(run["grads"])
            if label != "reference":
                # The second step (no headers, every receive posted ahead) repeats the first bit for bit.
                assert run["headers"][0] > 0 and run["headers"][1] == 0, (label, run["headers"])
                assert run["posted_ahead"][0] == run["posted_ahead"][1] > 0, (label, run["posted_ahead"])
                for name, grad in run["grads"].items():
                    assert torch.equal(grad, run["first_grads"][name]), f"{label}: step 2 differs at {name}"
            merged["calls"] += run.get("overlap_calls", 0)
            merged["fb"] += run.get("overlapped_actions", 0)
    reference = runs.pop("reference")
    base = runs["1f1b"]
    assert len(base["grads"]) == len(reference["grads"]) == 8
    for name, want in reference["grads"].items():
        torch.testing.assert_close(base["grads"][name], want, rtol=1e-12, atol=1e-14)
    for label, run in runs.items():
        assert run["grads"].keys() == base["grads"].keys(), label
        for name, grad in run["grads"].items():
            assert torch.equal(grad, base["grads"][name]), f"{label}: {name} differs from 1f1b"
        assert run["loss"] == base["loss"], label
    assert runs["dualpipev"]["fb"] > 0 and runs["dualpipev"]["calls"] == 0
    assert runs["dualpipev hook"]["calls"] == runs["dualpipev hook"]["fb"] > 0
    assert runs["dualpipev no-overlap"]["fb"] == 0
    # zbv-auto planned with B twice F runs an order the fixed zbv does not (so its equality above means something).
    costed = build_schedule("zbv-auto", 4, 4, f=1.0, b=2.0, w=0.5)
    assert "zbv-auto costed" in runs and costed.rank_actions != build_schedule("zbv", 4, 4).rank_actions
    # Not trivially passing: a gradient off by one ulp is told apart.
    name, grad = next(iter(base["grads"].items()))
    assert not torch.equal(torch.nextafter(grad, grad + 1), grad)


def test_profile_guided_zb_auto(two_rank_results):
    """build_runtime(..., "auto"): both ranks profile, agree on one plan from the gathered costs, and the planned
    steps give the profiling step's gradients bit for bit."""
    results, _ = two_rank_results
    runs = [res["auto"] for res in results]
    for rank, run in enumerate(runs):
        assert (run["before"], run["after"]) == ("1f1b", "zb-auto"), rank
        assert run["bitwise"] and run["losses"][0] == run["losses"][1], rank
        assert all(c > 0 for c in run["costs"]) and all(n > 0 for n in run["bytes"]), rank
        assert 0 < run["w_memory"] <= 1 and run["limits"] == (4.0, 4.0)
        assert run["peak_memory"] <= 4.0 + 1e-9
    assert runs[0]["same_plan"] == runs[1]["same_plan"], "ranks planned different schedules"
    assert runs[0]["costs"] == runs[1]["costs"]
    assert "planned" in runs[0]["report"] and runs[1]["report"] is None


def test_split_backward_moe_and_mlp_stack(two_rank_results):
    results, _ = two_rank_results
    for rank, res in enumerate(results):
        _assert_check(f"1f1b split_backward rank {rank}", res["1f1b split_backward"], split=True)
        _assert_check(f"zb-h1 MoE rank {rank}", res["zb-h1 moe"], split=True)
        _assert_check(f"nn.Sequential MLP (zbv, 4 stages) rank {rank}", res["mlp"], split=True)


def test_shapes_agreed_once_and_receives_posted_ahead(two_rank_results):
    """Headers only on the first step and after reset_shapes(); then every receive is posted before its action
    needs it, and sends the peer provably consumed are released before the step ends."""
    results, _ = two_rank_results
    for rank, res in enumerate(results):
        _assert_check(f"steps with new shapes after reset_shapes, rank {rank}", res["reshape"], split=True)
        stats = res["reshape"]["stats"]
        assert stats["headers"][0] > 0 and stats["headers"][1] > 0 and stats["headers"][2] == 0, stats
        assert stats["receives"] == 2 and stats["posted_ahead"] == stats["receives"], stats
        assert stats["lead_ok"] and stats["peak_recv_bytes"] > 0 and stats["peak_send_bytes"] > 0, stats
    # Rank 0's activations are released when rank 1's gradient (sent after using them) arrives.
    assert results[0]["reshape"]["stats"]["released_early"] == 2


def test_shape_change_without_reset_is_refused(two_rank_results):
    results, _ = two_rank_results
    sender, peer = (res["shape change"] for res in results)
    assert sender.startswith("ValueError") and "reset_shapes()" in sender and "1F0" not in sender, sender
    assert "0F0" in sender and "shape (3, 5, " in sender, sender
    # The peer times out, or sees the sender's process leave first: either way a RuntimeError naming both.
    assert peer.startswith("RuntimeError") and "1F0" in peer and "from rank 0" in peer, peer


def test_wrong_reference_is_rejected(two_rank_results):
    results, _ = two_rank_results
    assert any(res["negative"]["bad"] for res in results), "perturbed targets went unnoticed"


def test_receives_are_posted_in_the_senders_order(two_rank_results):
    # zbv consumes rank 0's messages in a different order than rank 0 sends them: a transport that pairs
    # messages by posting order (NCCL) would hand an activation to a gradient receive of the same shape.
    assert channel_order_problems(build_schedule("zbv", 4, 4))
    results, _ = two_rank_results
    for src, dst in ((0, 1), (1, 0)):
        sent = [tag for op, peer, tag in results[src]["posting"] if op == "send" and peer == dst]
        posted = [tag for op, peer, tag in results[dst]["posting"] if op == "recv" and peer == src]
        assert sent and sent == posted, f"rank {src} -> {dst}: sent {sent}, receives posted {posted}"


def test_activation_memory_follows_schedule(two_rank_results):
    results, _ = two_rank_results
    peaks = results[0]["memory"]
    assert all(v > 0 for v in peaks.values()), peaks
    # Rank 0 of 2 with 6 microbatches: GPipe holds 6 forwards' activations, 1F1B at most 2.
    assert peaks["gpipe"] == 3 * peaks["1f1b"], peaks


def test_timeline_gathered_and_rendered(two_rank_results):
    results, _ = two_rank_results
    tl = results[0]["timeline"]
    print("\n" + tl["report"])
    assert "measured bubble" in tl["report"] and "simulated" in tl["report"]
    expected = {f"{s}{k}{i}" for s in range(2) for k in "FBW" for i in range(4)}
    assert set(tl["names"]) == expected
    assert tl["comm"] > 0
    assert 0.0 <= tl["measured"] < 1.0 and 0.0 <= tl["simulated_measured_costs"] < 1.0
    # The runtime's events replay through the simulator's engine, and the overhead split adds up on real events.
    assert 0.0 <= tl["replay"] < 1.0 and "replayed" in tl["report"]
    assert len(tl["split"]) == 2
    for overhead, dispatch, transport, propagated, producer_wait in tl["split"]:
        assert min(dispatch, transport, producer_wait) >= 0.0
        assert overhead == pytest.approx(dispatch + transport + propagated, abs=1e-9)
    runtime_cpu, action_cpu = tl["cpu"]
    assert runtime_cpu > 0.0 and action_cpu > 0.0  # the runtime's own CPU is measured apart from the actions'
    trace_path, png_path = map(Path, tl["files"])
    trace = json.loads(trace_path.read_text())
    assert {e["name"] for e in trace["traceEvents"] if e.get("ph") == "X"} >= expected
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert results[1]["timeline"]["report"] is None, "only the gathering rank reports"


@pytest.mark.parametrize("name", [n for n, _ in workers.SCHEDULES])
def test_every_schedule_four_ranks(four_rank_results, name):
    for rank, res in enumerate(four_rank_results):
        _assert_check(f"pp4 {name} rank {rank}", res[f"pp4 {name}"], split=name in workers.SPLIT)


@pytest.mark.parametrize("name", [n for n, _ in workers.SCHEDULES])
def test_pipeline_x_data_parallel(four_rank_results, name):
    for rank, res in enumerate(four_rank_results):
        out = res[f"pp2xdp2 {name}"]
        _assert_check(f"pp2 x dp2 {name} rank {rank}", out, split=name in workers.SPLIT)
        # Buckets complete inside the step (at their last W or B), not only in finish_grad_sync().
        assert sum(out["launched_early"]) > 0, f"{name} rank {rank}: no bucket reduction overlapped the step"


def test_schedule_must_fit_the_pipeline_group(two_rank_results):
    # Issue 11 item 9: a one-rank schedule under a 2-rank group used to run the whole model on both ranks.
    results, _ = two_rank_results
    for rank, res in enumerate(results):
        out = res["group size"]
        errors = out["errors"]
        for label in (
            "build 1-rank schedule, 2-rank default group",
            "PipelineRuntime 1-rank schedule, 2-rank default group",
        ):
            msg = errors[label]
            assert msg is not None and msg.startswith("ValueError"), f"rank {rank}, {label}: built ({msg})"
            assert "n_ranks=1" in msg and "default process group has 2 ranks" in msg, msg
            assert "'1f1b'" in msg or "'gpipe'" in msg, msg
        msg = errors["build 2-rank schedule, wrong rank"]
        assert msg is not None and f"rank={1 - rank} but this process is rank {rank}" in msg, msg
        # The same one-rank schedule on a one-rank group of its own is accepted and exact.
        _assert_check(f"one-rank pipeline group, rank {rank}", out, split=False)
