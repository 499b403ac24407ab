"""Actions and schedules as data: the compact string form round-trips, the text form round-trips, and the
helpers a runtime relies on (stage ownership, neighbours, which transfers surround an action) are right.

Why: golden files, error messages and profiler ranges all use these strings, and the runtime derives its
point-to-point traffic from ``recv_before`` / ``send_after``.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from splitgrad.pipeline import Action, ActionKind, Schedule, build_schedule
from splitgrad.pipeline.ir.actions import Transfer, parse_action

F, B, W, BW = ActionKind.F, ActionKind.B, ActionKind.W, ActionKind.BW


def test_string_form_examples():
    assert str(Action(1, F, 0)) == "1F0"
    assert Action(2, W, 3).name == "2W3"
    assert str(Action(0, BW, 12)) == "0BW12"
    assert parse_action("2W3") == Action(2, W, 3)
    assert parse_action("10B11") == Action(10, B, 11)
    assert parse_action(" 0BW5 ") == Action(0, BW, 5)
    assert Action.parse("3F7").kind is F


@given(st.integers(0, 10_000), st.sampled_from([F, B, W, BW]), st.integers(0, 10_000))
def test_string_form_round_trips(stage, kind, microbatch):
    action = Action(stage, kind, microbatch)
    assert parse_action(str(action)) == action
    assert parse_action(action.name) == action


@pytest.mark.parametrize("bad", ["", "F0", "1F", "1X0", "-1F0", "1f0", "1 F 0", "1FW0"])
def test_parse_rejects_malformed(bad):
    with pytest.raises(ValueError, match="cannot parse action"):
        parse_action(bad)


def test_kind_behaves_like_its_string():
    assert ActionKind("BW") is BW
    assert F == "F" and hash(F) == hash("F")


@pytest.mark.parametrize(
    ("name", "n_stages", "m"), [("zb-h1", 4, 5), ("zbv", 6, 4), ("interleaved-1f1b", 6, 3), ("1f1b", 3, 2)]
)
def test_text_form_round_trips(name, n_stages, m):
    schedule = build_schedule(name, n_stages, m)
    text = schedule.to_text()
    assert Schedule.from_text(text) == schedule
    assert Schedule.from_text("# comment\n\n" + text) == schedule
    changed = text.replace(schedule.rank_actions[0][0].name, "0F99", 1)
    assert Schedule.from_text(changed) != schedule


def test_from_text_errors():
    good = build_schedule("1f1b", 2, 2).to_text()
    with pytest.raises(ValueError, match="unknown field"):
        Schedule.from_text(good + "bogus 1\n")
    with pytest.raises(ValueError, match="lacks fields"):
        Schedule.from_text("\n".join(line for line in good.splitlines() if not line.startswith("stages")))
    with pytest.raises(ValueError, match="disagrees"):
        Schedule.from_text(good.replace("stages 2", "stages 3"))


def test_constructor_checks_shape():
    acts = ((Action(0, F, 0),), (Action(1, F, 0),))
    with pytest.raises(ValueError, match="n_microbatches"):
        Schedule("x", 0, (0, 1), acts)
    with pytest.raises(ValueError, match="outside"):
        Schedule("x", 1, (0, 2), acts)
    with pytest.raises(ValueError, match=r"ranks \[1\] hold no stage"):
        Schedule("x", 1, (0, 0), acts)
    with pytest.raises(ValueError, match="single line"):
        Schedule("a\nb", 1, (0, 1), acts)


def test_runtime_helpers_zbv():
    """ZB-V: rank r holds stages r and 2p-1-r; the turn of the V is a local hand-off, not a transfer."""
    s = build_schedule("zbv", 6, 3)
    assert s.n_ranks == 3 and s.stage_to_rank == (0, 1, 2, 2, 1, 0)
    assert s.stages_of(0) == (0, 5) and s.stages_of(2) == (2, 3)
    assert s.rank_of(4) == 1
    assert s.neighbours(0) == (None, 1)
    assert s.neighbours(2) == (1, 2)
    assert s.neighbours(5) == (1, None)
    assert s.recv_before(Action(3, F, 1)) is None  # stage 2 -> 3 both on rank 2
    assert s.recv_before(Action(4, F, 1)) == Transfer("activation", 3, 4, 1, 2, 1)
    assert s.send_after(Action(4, F, 1)) == Transfer("activation", 4, 5, 1, 1, 0)
    assert s.send_after(Action(5, F, 0)) is None  # last stage: the loss is local
    assert s.recv_before(Action(5, B, 0)) is None
    assert s.send_after(Action(5, B, 0)) == Transfer("gradient", 5, 4, 0, 0, 1)
    assert s.recv_before(Action(1, BW, 2)) == Transfer("gradient", 2, 1, 2, 2, 1)
    assert s.send_after(Action(0, B, 2)) is None
    assert s.recv_before(Action(1, W, 2)) is None and s.send_after(Action(1, W, 2)) is None
    with pytest.raises(ValueError, match="stage 6 out of range"):
        s.rank_of(6)
    with pytest.raises(ValueError, match="rank 3 out of range"):
        s.stages_of(3)


def test_every_transfer_has_a_matching_receive():
    """Each send a runtime posts is received exactly once, by the rank the receiving action runs on."""
    for name, n_stages in [("1f1b", 4), ("interleaved-1f1b", 8), ("zbv", 8), ("dualpipev", 8)]:
        s = build_schedule(name, n_stages, 8)
        sends = sorted(t for acts in s.rank_actions for a in acts for t in s.sends(a))
        recvs = sorted(t for acts in s.rank_actions for a in acts for t in s.receives(a))
        assert sends == recvs
        assert len(sends) == 2 * 8 * sum(1 for x in range(n_stages - 1) if s.rank_of(x) != s.rank_of(x + 1))
