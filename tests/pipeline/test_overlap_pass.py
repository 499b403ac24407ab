"""The overlap pass: 1F1B rewritten into warm-up forwards, overlapped ``F+B`` pairs and cool-down backwards.

Why: the pass decides which forward runs beside which backward in the 1F1B steady state (Megatron-Core's
combined 1F1B for MoE all-to-all overlap). It must keep every action exactly once and in dependency order
(validate), cost no more than 1F1B when nothing is hidden and less whenever something is (simulate with
``overlap``), survive the gradient-sync lowering and the text form, and refuse schedules it cannot rewrite.
"""

from __future__ import annotations

import os

import pytest

from splitgrad.pipeline import ActionKind, Schedule, ScheduleError, build_schedule, simulate, validate
from splitgrad.pipeline.ir.actions import OverlapAction
from splitgrad.pipeline.passes import add_grad_sync, default_lookahead, fuse_overlap_pairs
from tests.pipeline.helpers import GOLDEN_DIR, golden_text


def _order(acts, kinds):
    return [p for a in acts for p in a.parts if p.kind in kinds]


@pytest.mark.parametrize("p, m", [(2, 4), (2, 8), (3, 6), (4, 8), (4, 16)])
def test_pairs_keep_order_and_cost_no_more_than_1f1b(p, m):
    base = build_schedule("1f1b", p, m)
    fused = fuse_overlap_pairs(base)
    validate(fused)
    assert fused.name == "1f1b+overlap" and fused.stage_to_rank == base.stage_to_rank
    for r in range(p):
        acts = fused.rank_actions[r]
        # Forwards and backwards in the same order as 1F1B; only their interleaving changed.
        for kinds in ({ActionKind.F}, {ActionKind.B, ActionKind.BW}):
            assert _order(acts, kinds) == _order(base.rank_actions[r], kinds)
        k = min(m, default_lookahead(p, r))
        pairs = [a for a in acts if type(a) is OverlapAction]
        assert len(pairs) == m - k
        assert all(a.forward.microbatch == a.backward.microbatch + k for a in pairs)
    f, b = 1.0, 2.0
    plain = simulate(base, f, b, 0.0).makespan
    spans = [simulate(fused, f, b, 0.0, overlap=o).makespan for o in (0.0, 0.5, 1.0)]
    assert spans[0] == pytest.approx(plain)
    assert spans[0] > spans[1] > spans[2]
    # Activation memory: 2 (p - r) microbatches in flight instead of p - r (rank 0 clipped to m).
    assert simulate(fused).peak_activations == tuple(min(m, 2 * (p - r)) for r in range(p))


def test_negative_adjacent_pairs_are_slower_and_small_lookahead_deadlocks():
    """Not trivially passing: pairing each B with the very next F (1F1B's own warm-up + 1) alternates the
    neighbours' pairs, which the simulator must show as slower than 1F1B even with full overlap; a lookahead
    that pulls a forward ahead of its input is refused by validation."""
    base = build_schedule("1f1b", 4, 8)
    adjacent = fuse_overlap_pairs(base, lookahead=[4 - r for r in range(4)])
    assert simulate(adjacent, 1.0, 2.0, 0.0, overlap=1.0).makespan > simulate(base, 1.0, 2.0, 0.0).makespan
    with pytest.raises(ScheduleError, match="deadlock"):
        fuse_overlap_pairs(build_schedule("1f1b", 3, 6), lookahead=[1, 1, 1])


def test_split_backward_sync_points_and_text_form():
    fused = fuse_overlap_pairs(build_schedule("1f1b", 2, 4, split_backward=True))
    assert [a.name for a in fused.rank_actions[1]] == [
        "1F0", "1F1+1B0", "1W0", "1F2+1B1", "1W1", "1F3+1B2", "1W2", "1B3", "1W3",
    ]  # fmt: skip
    lowered = add_grad_sync(fused)
    validate(lowered)
    assert Schedule.from_text(lowered.to_text()) == lowered
    simulate(lowered, sync=0.5, overlap=0.5)


def test_refusals_name_the_problem():
    with pytest.raises(ValueError, match="one stage per rank or the interleaved"):
        fuse_overlap_pairs(build_schedule("dualpipev", 4, 8))
    with pytest.raises(ValueError, match="already holds"):
        fuse_overlap_pairs(fuse_overlap_pairs(build_schedule("1f1b", 2, 4)))
    with pytest.raises(ValueError, match="already holds 0R"):
        fuse_overlap_pairs(add_grad_sync(build_schedule("1f1b", 2, 4)))
    with pytest.raises(ValueError, match="no pair"):
        fuse_overlap_pairs(build_schedule("1f1b", 2, 1))
    with pytest.raises(ValueError, match=r"lookahead must give one value >= 1 per rank \(2\)"):
        fuse_overlap_pairs(build_schedule("1f1b", 2, 4), lookahead=[3])


def test_golden_1f1b_overlap():
    """Reviewed text (``SPLITGRAD_UPDATE_GOLDEN=1`` regenerates; review the diff)."""
    text = golden_text(fuse_overlap_pairs(build_schedule("1f1b", 3, 6)))
    path = GOLDEN_DIR / "1f1b_overlap_p3_m6.txt"
    if os.environ.get("SPLITGRAD_UPDATE_GOLDEN"):
        path.write_text(text)
    assert path.read_text() == text
