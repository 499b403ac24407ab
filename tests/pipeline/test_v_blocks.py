"""V-Half and V-Min (controllable-memory V schedules) and zbv-auto below the fixed V's memory.

Why: a user short of activation memory picks these by their peak; the peak is the contract (a rank that holds
one activation more than promised runs out of memory), the bubble what they pay for it. The peaks are the
paper's closed forms; the bubbles are bounded by the zero-bubble authors' own generator (sail-sg/
zero-bubble-pipeline-parallelism, ``zbv_greedy.py``), whose orders were simulated with splitgrad's simulator
when these families were written: the figures below are those upper bounds, not this code's output.
"""

from __future__ import annotations

import pytest

from splitgrad.pipeline import Action, ActionKind, Schedule, ScheduleError, build_schedule, simulate, validate
from splitgrad.pipeline.schedules._v_blocks import block_schedule
from splitgrad.pipeline.schedules.v_half import v_half_block, v_half_peak
from splitgrad.pipeline.schedules.v_min import v_min_block, v_min_peak

FAMILIES = {"v-min": v_min_peak, "v-half": v_half_peak}

# Reference generator's bubble ratio at unit costs (F = B = W = 1, comm 0), simulated by splitgrad:
# (p, m) -> (V-Min, V-Half).
REFERENCE_UNIT = {
    (2, 8): (0.0588, 0.0204),
    (3, 16): (0.0495, 0.0495),
    (4, 8): (0.1864, 0.0943),
    (4, 24): (0.0710, 0.0336),
    (5, 16): (0.1351, 0.1028),
    (6, 8): (0.2615, 0.1864),
    (8, 16): (0.2195, 0.1504),
    (8, 32): (0.1233, 0.0813),
}
# The zero-bubble paper's profiled costs halved per V stage (1.5B and 6.2B, p = 8): (m, f, b, w, comm) ->
# the reference generator's (V-Min, V-Half) bubble ratio.
REFERENCE_PAPER = {
    (24, 9.2610, 9.0430, 4.6685, 0.601): (0.3353, 0.1702),
    (32, 9.2565, 9.0430, 4.6655, 0.626): (0.3103, 0.1339),
    (24, 14.8590, 14.7220, 9.9635, 0.527): (0.2721, 0.1447),
    (32, 14.9010, 14.7140, 9.7650, 0.577): (0.2496, 0.1145),
}


@pytest.mark.parametrize("name", sorted(FAMILIES))
@pytest.mark.parametrize("p", range(1, 9))
def test_peak_is_the_closed_form(name, p):
    """Most stage activations a rank holds: ``2 floor((p + 4) / 3)`` (V-Min), ``2 floor((p + 2) / 2)`` (V-Half),
    or ``2m`` when fewer microbatches cannot fill it; against 1F1B's ``2p`` half-size activations."""
    closed = FAMILIES[name](p)
    for m in range(1, 2 * p + 3):
        schedule = build_schedule(name, 2 * p, m)
        validate(schedule)
        peaks = simulate(schedule).peak_activations
        assert max(peaks) == min(closed, 2 * m), (name, p, m, peaks)
    assert closed <= 2 * p + 2  # never above the fixed V's (+2 only at p = 1, 2 where 2p is tiny)


def test_memory_fractions_of_1f1b():
    """About a third (V-Min) and a half (V-Half) of 1F1B's memory at large p, as the paper's names say."""
    p = 48
    assert v_min_peak(p) / (2 * p) == pytest.approx(1 / 3, abs=0.03)
    assert v_half_peak(p) / (2 * p) == pytest.approx(1 / 2, abs=0.03)


@pytest.mark.parametrize(("p", "m"), sorted(REFERENCE_UNIT))
def test_unit_cost_bubble_at_most_the_reference(p, m):
    for j, name in enumerate(("v-min", "v-half")):
        result = simulate(build_schedule(name, 2 * p, m))
        assert result.bubble_ratio <= REFERENCE_UNIT[(p, m)][j] + 5e-5, (name, p, m, result.bubble_ratio)
        assert max(result.peak_activations) == FAMILIES[name](p)
    # Not trivially passing: where the two differ, V-Min (less memory) breaks V-Half's bound.
    if REFERENCE_UNIT[(p, m)][0] > REFERENCE_UNIT[(p, m)][1]:
        assert simulate(build_schedule("v-min", 2 * p, m)).bubble_ratio > REFERENCE_UNIT[(p, m)][1] + 5e-5


@pytest.mark.parametrize("costs", sorted(REFERENCE_PAPER))
def test_paper_cost_bubble_at_most_the_reference(costs):
    m, f, b, w, comm = costs
    for j, name in enumerate(("v-min", "v-half")):
        bubble = simulate(build_schedule(name, 16, m), f, b, w, comm).bubble_ratio
        assert bubble <= REFERENCE_PAPER[costs][j] + 5e-5, (name, costs, bubble)
    # Not trivially passing: the raw building block, W in its free slots and no squeeze, breaks V-Half's bound.
    assert (
        simulate(
            block_schedule("v-half-raw", 8, m, v_half_block(8), squeeze=False), f, b, w, comm
        ).bubble_ratio
        > REFERENCE_PAPER[costs][1] + 5e-5
    )


@pytest.mark.parametrize("block", [v_min_block, v_half_block])
def test_blocks_keep_every_rank_in_distinct_slots(block):
    """The four passes of a block take different slots of the 6-slot period on every rank (the reason for the
    extra gap when ``3 | p`` / ``2 | p``), and the V's passes follow their producers."""
    for p in range(1, 13):
        for r, (f_down, f_up, b_up, b_down) in enumerate(block(p)):
            assert len({f_down % 6, f_up % 6, b_up % 6, b_down % 6}) == 4, (block.__name__, p, r)
            assert f_down < f_up < b_up < b_down
            if r > 0:
                prev = block(p)[r - 1]
                assert f_down > prev[0] and b_up > prev[2] and f_up < prev[1] and b_down < prev[3]


def test_order_is_cost_independent_and_deterministic():
    a = build_schedule("v-half", 8, 12)
    assert a == build_schedule("v-half", 8, 12)
    assert a.stage_to_rank == (0, 1, 2, 3, 3, 2, 1, 0)
    kinds = {a.kind for acts in a.rank_actions for a in acts}
    assert kinds == {ActionKind.F, ActionKind.B, ActionKind.W}


def test_a_schedule_over_the_promised_peak_is_caught():
    """Negative check: move one forward of V-Min earlier on a rank; validate still accepts the order, but the
    rank's peak exceeds the closed form, which the peak check above rejects."""
    p, m = 4, 8
    schedule = build_schedule("v-min", 2 * p, m)
    acts = list(schedule.rank_actions[0])
    late = max(i for i, a in enumerate(acts) if a == Action(0, ActionKind.F, 6))
    moved = acts.pop(late)
    first_b = next(i for i, a in enumerate(acts) if a.kind is ActionKind.B)
    acts.insert(first_b, moved)
    bad = Schedule("v-min", m, schedule.stage_to_rank, (tuple(acts), *schedule.rank_actions[1:]))
    validate(bad)
    assert max(simulate(bad).peak_activations) > v_min_peak(p)
    # And an out-of-order one (a W before its B) is refused outright.
    broken = [a for a in schedule.rank_actions[1] if a != Action(1, ActionKind.W, 0)]
    broken.insert(0, Action(1, ActionKind.W, 0))
    with pytest.raises(ScheduleError):
        validate(
            Schedule(
                "v-min",
                m,
                schedule.stage_to_rank,
                (schedule.rank_actions[0], tuple(broken), *schedule.rank_actions[2:]),
            )
        )


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_rejects_odd_stage_counts(name):
    with pytest.raises(ValueError, match=f"{name}.*n_stages must be even"):
        build_schedule(name, 5, 4)
    with pytest.raises(ValueError, match="does not take option"):
        build_schedule(name, 4, 4, memory_limit=3)


# -- zbv-auto below the fixed V's 2p ---------------------------------------------------------------------------

COSTS = [(1.0, 1.0, 1.0, 0.0), (1.0, 2.0, 0.5, 0.0), (2.0, 1.0, 1.0, 0.1), (9.26, 9.04, 4.67, 0.6)]


@pytest.mark.parametrize(("p", "m"), [(3, 9), (4, 8)])
@pytest.mark.parametrize("costs", COSTS)
def test_zbv_auto_down_to_v_min_memory(p, m, costs):
    """Every limit from V-Min's peak to ``2p - 1`` gets a plan within it, never worse than the building-block
    schedules that fit (V-Min at its peak, V-Half from its peak on)."""
    f, b, w, comm = costs
    block_bubble = {n: simulate(build_schedule(n, 2 * p, m), f, b, w, comm).bubble_ratio for n in FAMILIES}
    previous = 1.0
    for limit in range(v_min_peak(p), 2 * p):
        plan = build_schedule("zbv-auto", 2 * p, m, f=f, b=b, w=w, comm=comm, memory_limit=limit)
        result = simulate(plan, f, b, w, comm)
        assert max(result.peak_activations) <= limit
        fitting = [n for n in FAMILIES if FAMILIES[n](p) <= limit]
        assert result.bubble_ratio <= min(block_bubble[n] for n in fitting) + 1e-12, (limit, fitting)
        assert result.bubble_ratio <= previous + 1e-12  # more memory never hurts
        previous = result.bubble_ratio


def test_zbv_auto_below_v_min_down_to_one_activation_per_stage():
    """Below V-Min's peak only the split greedy passes fit: valid plans within the limit, the bubble growing as
    the limit shrinks; a limit of 1 (less than one activation per stage) is refused."""
    p, m = 4, 8
    previous = 0.0
    for limit in range(v_min_peak(p) - 1, 1, -1):
        plan = build_schedule("zbv-auto", 2 * p, m, memory_limit=limit)
        validate(plan)
        result = simulate(plan)
        assert max(result.peak_activations) <= limit
        assert result.bubble_ratio >= previous - 1e-12
        previous = result.bubble_ratio
    assert previous > simulate(build_schedule("v-min", 2 * p, m)).bubble_ratio
    with pytest.raises(ValueError, match="memory_limit must be a number >= 2"):
        build_schedule("zbv-auto", 2 * p, m, memory_limit=1)


def test_zbv_auto_default_memory_unchanged():
    """At the default ``2p`` the small-memory candidates are not added: the plan is the one zbv-auto made
    before (never worse than ``zbv``)."""
    plan = build_schedule("zbv-auto", 8, 8, f=1.0, b=2.0, w=0.5)
    assert max(simulate(plan).peak_activations) <= 8
    assert (
        simulate(plan, 1, 2, 0.5).bubble_ratio
        <= simulate(build_schedule("zbv", 8, 8), 1, 2, 0.5).bubble_ratio
    )
