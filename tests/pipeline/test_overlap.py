"""Overlapped forward+backward actions (torch's OVERLAP_F_B, DualPipe's overlapped_forward_backward).

Why: a pair runs as one unit, so both halves' inputs must exist before it starts and both outputs exist only
at its end; validation must check both halves' dependencies, the simulator must cost the pair with the
configured hidden fraction, and the string, text, timeline and golden forms must carry it unchanged.
"""

from __future__ import annotations

import pytest

from splitgrad.pipeline import Action, ActionKind, Schedule, ScheduleError, build_schedule, simulate, validate
from splitgrad.pipeline.ir.actions import OverlapAction, parse_action
from splitgrad.pipeline.passes import add_grad_sync

F, B, W, BW = ActionKind.F, ActionKind.B, ActionKind.W, ActionKind.BW


def test_string_form_round_trips():
    pair = OverlapAction(Action(0, F, 3), Action(3, BW, 1))
    assert str(pair) == pair.name == "0F3+3BW1"
    assert parse_action("0F3+3BW1") == pair and parse_action(" 2F0+1B4 ") == OverlapAction(
        Action(2, F, 0), Action(1, B, 4)
    )
    assert pair.kind is ActionKind.FB and pair.stage == 0 and pair.microbatch is None
    assert pair.parts == (Action(0, F, 3), Action(3, BW, 1))
    for bad in ("0B1+0F2", "0F1+0W2", "0F1+0F2", "0F1+", "+0B1", "0F1+0B1+0B2"):
        with pytest.raises(ValueError, match="cannot parse action"):
            parse_action(bad)
    sched = build_schedule("dualpipev", 6, 8)
    assert any(type(a) is OverlapAction for acts in sched.rank_actions for a in acts)
    assert Schedule.from_text(sched.to_text()) == sched


def _pairs(overlap_at: list[tuple[int, int]]) -> Schedule:
    """1F1B on 2 ranks, 3 microbatches, with the (F, BW) neighbours at the given rank positions fused."""
    base = build_schedule("1f1b", 2, 3)
    lists = []
    for r, acts in enumerate(base.rank_actions):
        acts = list(acts)
        for rr, j in sorted(overlap_at, reverse=True):
            if rr == r:
                acts[j : j + 2] = [OverlapAction(acts[j], acts[j + 1])]
        lists.append(acts)
    return Schedule("pairs", 3, base.stage_to_rank, lists)


def test_validate_checks_both_halves():
    base = build_schedule("1f1b", 2, 3)
    assert [a.name for a in base.rank_actions[0]] == ["0F0", "0F1", "0BW0", "0F2", "0BW1", "0BW2"]
    ok = _pairs([(0, 3)])  # fuses 0F2 and 0BW1
    validate(ok)
    assert ok.rank_actions[0][3] == OverlapAction(Action(0, F, 2), Action(0, BW, 1))
    # The backward half needs 1BW1, which needs 1F1, which needs this very pair's forward half: a cycle.
    base_lists = [list(a) for a in base.rank_actions]
    base_lists[0] = [Action(0, F, 0), OverlapAction(Action(0, F, 1), Action(0, BW, 1)), Action(0, BW, 0)]
    base_lists[0] += [Action(0, F, 2), Action(0, BW, 2)]
    cyclic = Schedule("cyclic", 3, base.stage_to_rank, base_lists)
    with pytest.raises(ScheduleError, match=r"stuck at 0F1\+0BW1"):
        validate(cyclic)
    # A pair repeating a forward: counted like any action.
    dup = [list(a) for a in base.rank_actions]
    dup[0][4] = OverlapAction(Action(0, F, 2), Action(0, BW, 1))
    with pytest.raises(ScheduleError, match="0F2 appears 2 times"):
        validate(Schedule("dup", 3, base.stage_to_rank, dup))
    # Halves on different ranks.
    far = [list(a) for a in base.rank_actions]
    far[0][3:5] = [OverlapAction(Action(0, F, 2), Action(1, BW, 1))]
    with pytest.raises(ScheduleError, match="belongs to rank 1"):
        validate(Schedule("far", 3, base.stage_to_rank, far))


@pytest.mark.parametrize("overlap", [0.0, 0.25, 1.0])
def test_simulator_costs_pairs_with_the_hidden_fraction(overlap):
    f, b, w = 1.0, 1.5, 0.5
    sched = build_schedule("dualpipev", 4, 6)
    result = simulate(sched, f, b, w, overlap=overlap)
    plain = simulate(build_schedule("dualpipev", 4, 6, overlap=False), f, b, w)
    events = [e for e in result.events() if e.kind == "FB"]
    assert events
    for e in events:
        assert e.end - e.start == pytest.approx(f + b + w - overlap * min(f, b + w))
    if overlap == 0.0:
        # Fusing only makes each pair wait for both inputs: never faster than the unfused order.
        assert result.makespan >= plain.makespan
    else:
        assert result.makespan < simulate(sched, f, b, w).makespan
    assert result.peak_activations == plain.peak_activations
    with pytest.raises(ValueError, match="overlap must be a fraction"):
        simulate(sched, overlap=1.5)


def test_timelines_show_pairs_and_sync_points(tmp_path):
    sched = add_grad_sync(build_schedule("dualpipev", 4, 5))
    result = simulate(sched, sync=0.5)
    ascii_art = result.to_ascii()
    assert "0F3+3BW1" in ascii_art
    trace = result.to_chrome_trace()["traceEvents"]
    names = {ev.get("name") for ev in trace}
    assert {"0F3+3BW1", "0R", "3RF"} <= names
    pytest.importorskip("matplotlib")
    assert result.save_png(tmp_path / "dualpipev.png").stat().st_size > 0


def test_graph_capture_order_takes_a_lowered_rank_list():
    """A rank's action list goes to make_graphed_callables as its capture order: pairs capture both parts,
    sync points nothing, so the lowered dualpipev list gives the unfused list's captures."""
    from splitgrad.graphs.order import normalize_order

    lowered = add_grad_sync(build_schedule("dualpipev", 4, 5))
    plain = build_schedule("dualpipev", 4, 5, overlap=False)
    for r in range(2):
        stages = list(lowered.stages_of(r))
        got = normalize_order(lowered.rank_actions[r], stages=stages, defers=[True, True])
        want = normalize_order(plain.rank_actions[r], stages=stages, defers=[True, True])
        assert got == want
        strings = normalize_order(
            [a.name for a in lowered.rank_actions[r]], stages=stages, defers=[True, True]
        )
        assert strings == want
    with pytest.raises(ValueError, match="cannot parse capture-order entry"):
        normalize_order(["0X1"], stages=[0], defers=[True])
