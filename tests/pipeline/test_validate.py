"""validate() rejects every kind of broken schedule with a message naming the offending action.

Why: a runtime executing a broken schedule hangs (a deadlock under blocking receives) or silently drops or
doubles a gradient (a missing or repeated W); both must be caught before any process starts.
"""

from __future__ import annotations

import pytest

from splitgrad.pipeline import Action, ActionKind, Schedule, ScheduleError, build_schedule, simulate, validate
from splitgrad.pipeline.ir.actions import parse_action
from splitgrad.pipeline.ir.validate import find_problems, render_listing

F, B, W, BW = ActionKind.F, ActionKind.B, ActionKind.W, ActionKind.BW


def _sched(*ranks: str, m: int = 2, stage_to_rank: tuple[int, ...] | None = None) -> Schedule:
    lists = [tuple(parse_action(tok) for tok in r.split()) for r in ranks]
    return Schedule("handmade", m, stage_to_rank or tuple(range(len(ranks))), lists)


GOOD = ("0F0 0F1 0B0 0W0 0B1 0W1", "1F0 1B0 1F1 1B1 1W0 1W1")


def test_handmade_good_schedule_passes():
    s = _sched(*GOOD)
    validate(s)
    assert find_problems(s) == []


@pytest.mark.parametrize(
    ("ranks", "fragments"),
    [
        # missing W: its gradient would never be computed
        (("0F0 0F1 0B0 0W0 0B1", GOOD[1]), ["incomplete", "missing 0W1"]),
        # a repeated W: the gradient would be counted twice
        (("0F0 0F1 0B0 0W0 0B1 0W1 0W1", GOOD[1]), ["0W1 appears 2 times"]),
        # both a full backward and a split one
        (("0F0 0F1 0B0 0W0 0BW1 0W1", GOOD[1]), ["0BW1 and a split 0B1/0W1 both present"]),
        # no backward at all
        (("0F0 0F1 0B0 0W0", GOOD[1]), ["missing backward of stage 0 microbatch 1"]),
        # missing forward
        (("0F0 0B0 0W0 0B1 0W1", GOOD[1]), ["missing 0F1"]),
        # action on the wrong rank
        (("0F0 0F1 0B0 0W0 0B1 0W1 1F0", "1B0 1F1 1B1 1W0 1W1"), ["malformed", "1F0 belongs to rank 1"]),
        # microbatch out of range
        (("0F0 0F1 0F2 0B0 0W0 0B1 0W1", GOOD[1]), ["0F2 names microbatch 2 outside 0..1"]),
        # W before its B on the same rank
        (
            ("0F0 0F1 0W0 0B0 0B1 0W1", GOOD[1]),
            ["deadlock", "0W0", "0B0, which comes later on the same rank"],
        ),
        # backward before forward on the same rank
        (("0F0 0B1 0F1 0B0 0W0 0W1", GOOD[1]), ["0B1", "needs 0F1, which comes later on the same rank"]),
        # cross-rank cycle: rank 0 waits for 1B0, which rank 1 runs only after 1F1, which needs 0F1
        (("0F0 0B0 0F1 0W0 0B1 0W1", "1F1 1F0 1B0 1B1 1W0 1W1"), ["deadlock", "rank 0 is stuck at 0B0"]),
    ],
)
def test_broken_schedules_are_rejected(ranks, fragments):
    s = _sched(*ranks)
    with pytest.raises(ScheduleError) as info:
        validate(s)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, message
    assert "actions per rank" in message and "rank 1:" in message  # the listing view
    assert find_problems(s)
    with pytest.raises(ScheduleError):
        simulate(s)


def test_deadlock_message_marks_where_ranks_are_stuck():
    s = _sched("0F0 0B0 0F1 0W0 0B1 0W1", "1F1 1F0 1B0 1B1 1W0 1W1")
    with pytest.raises(ScheduleError) as info:
        validate(s)
    message = str(info.value)
    assert "[0B0]" in message and "[1F1]" in message
    assert "rank 1 is stuck at 1F1 (position 0): it waits for 0F1 from rank 0 (position 2)" in message


def test_swapping_two_actions_of_a_real_schedule_is_caught():
    """Move rank 2's first backward before its first forward in ZB-H1 (a plausible off-by-one)."""
    s = build_schedule("zb-h1", 4, 8)
    acts = list(s.rank_actions[2])
    first_b = next(j for j, a in enumerate(acts) if a.kind is B)
    acts.insert(0, acts.pop(first_b))
    broken = Schedule(
        s.name, s.n_microbatches, s.stage_to_rank, (*s.rank_actions[:2], acts, *s.rank_actions[3:])
    )
    with pytest.raises(ScheduleError, match=r"rank 2 is stuck at 2B0"):
        validate(broken)


def test_listing_window():
    s = build_schedule("1f1b", 2, 30)
    text = render_listing(s, {0: 30}, window=2)
    assert "[0F29]" not in text and "... " in text
    assert text.splitlines()[0].count(" ") < 15
    assert "[" + s.rank_actions[0][30].name + "]" in text


def test_non_action_items_are_reported():
    s = Schedule("bad", 1, (0,), ((Action(0, F, 0), ("x",)),))
    with pytest.raises(ScheduleError, match="is not an Action"):
        validate(s)
