"""Every schedule family: valid over a grid of (stages, microbatches), the paper's bubble closed forms,
memory bounds, clear errors for impossible arguments, and golden text files.

Why: the schedules are the contract the runtime executes; a wrong order deadlocks ranks or silently
computes at a different cost than the paper promises.
"""

from __future__ import annotations

import os
from fractions import Fraction

import pytest

from splitgrad.pipeline import ScheduleError, build_schedule, simulate, validate
from splitgrad.pipeline.ir.validate import channel_order_problems
from splitgrad.pipeline.schedules import schedule_names, schedule_options
from tests.pipeline.helpers import GOLDEN_DIR, golden_text

# (p ranks, m microbatches): small, m < p, m not a multiple of p, m = 2p - 1, large m.
GRID = [(1, 1), (1, 3), (2, 1), (2, 3), (3, 2), (3, 5), (4, 3), (4, 8), (4, 9), (5, 7), (6, 13), (8, 16)]


def _stages(name: str, p: int) -> int:
    return 2 * p if name in ("zbv", "zbv-auto", "dualpipev", "interleaved-1f1b", "v-half", "v-min") else p


def _expected_to_build(name: str, p: int, m: int) -> bool:
    if name == "interleaved-1f1b":
        return m % p == 0
    if name == "dualpipev":
        return m >= 2 * p
    return True


def test_registry_names():
    assert set(schedule_names()) == {
        "gpipe",
        "1f1b",
        "interleaved-1f1b",
        "zb-h1",
        "zb-h2",
        "zbv",
        "dualpipev",
        "zb-auto",
        "zbv-auto",
        "v-half",
        "v-min",
    }
    assert schedule_options("interleaved-1f1b") == ("stages_per_rank", "split_backward", "overlap")
    assert schedule_options("zb-h1") == ()


@pytest.mark.parametrize("name", schedule_names())
@pytest.mark.parametrize(("p", "m"), GRID)
def test_every_schedule_is_valid(name, p, m):
    if not _expected_to_build(name, p, m):
        with pytest.raises(ValueError, match=r"n_microbatches"):
            build_schedule(name, _stages(name, p), m)
        return
    schedule = build_schedule(name, _stages(name, p), m)
    assert schedule.n_ranks == p
    assert schedule.n_stages == _stages(name, p)
    validate(schedule)
    result = simulate(schedule)
    assert 0.0 <= result.bubble_ratio < 1.0
    # Deterministic: building twice gives the same lists.
    assert build_schedule(name, _stages(name, p), m) == schedule


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved-1f1b"])
def test_split_backward_variant(name):
    """B then W in place of BW: same order, the gradient leaves after B instead of after B + W."""
    stages = 8 if name == "interleaved-1f1b" else 4
    full = build_schedule(name, stages, 8)
    split = build_schedule(name, stages, 8, split_backward=True)
    validate(split)
    assert {a.kind.value for acts in split.rank_actions for a in acts} == {"F", "B", "W"}
    assert simulate(full, 1, 2, 0).makespan == simulate(split, 1, 2, 0).makespan
    assert simulate(split, 1, 2, 1).makespan < simulate(full, 1, 2, 1).makespan


def test_interleaved_more_stages_per_rank():
    s = build_schedule("interleaved-1f1b", 12, 6, stages_per_rank=4)
    assert s.n_ranks == 3 and s.stages_of(1) == (1, 4, 7, 10)
    validate(s)


@pytest.mark.parametrize(
    ("p", "m"), [(2, 4), (3, 3), (3, 7), (4, 4), (4, 8), (4, 12), (6, 18), (8, 8), (8, 24)]
)
def test_paper_closed_forms_with_unit_costs(p, m):
    """1F1B (p-1)/(p-1+m); ZB-H1 (p-1)(F+B-W) over (p-1)(F+B-W) + m(F+B+W); ZB-H2 and ZB-V zero."""
    one_result = simulate(build_schedule("1f1b", p, m))
    h1_result = simulate(build_schedule("zb-h1", p, m))
    one, h1 = one_result.bubble_ratio, h1_result.bubble_ratio
    assert one == pytest.approx(float(Fraction(p - 1, p - 1 + m)), abs=1e-12)
    assert h1 == pytest.approx(float(Fraction(p - 1, p - 1 + 3 * m)), abs=1e-12)
    # Bubble time (longest span minus work): ZB-H1's is a third of 1F1B's, (p - 1) vs 3(p - 1).
    assert _bubble_time(h1_result) == pytest.approx(p - 1) and _bubble_time(one_result) == pytest.approx(
        3 * (p - 1)
    )
    if m >= 2 * p - 1:
        assert simulate(build_schedule("zb-h2", p, m)).bubble_ratio == pytest.approx(0.0, abs=1e-12)
        assert simulate(build_schedule("zbv", 2 * p, m)).bubble_ratio == pytest.approx(0.0, abs=1e-12)
    if m % p == 0:
        inter = simulate(build_schedule("interleaved-1f1b", 2 * p, m)).bubble_ratio
        assert inter == pytest.approx(float(Fraction(p - 1, p - 1 + 2 * m)), abs=1e-12)
    # Not trivially passing: the formulas tell the schedules apart.
    assert abs(one - h1) > 1e-3


def _bubble_time(result) -> float:
    spans = [hi - lo for lo, hi in result.rank_spans]
    r = max(range(len(spans)), key=spans.__getitem__)
    return spans[r] - result.rank_work[r]


def test_issue_example_values():
    assert simulate(build_schedule("1f1b", 4, 8)).bubble_ratio == pytest.approx(3 / 11)
    assert simulate(build_schedule("zb-h1", 4, 8)).bubble_ratio == pytest.approx(1 / 9)
    assert simulate(build_schedule("zb-h2", 4, 8)).bubble_ratio == 0.0


@pytest.mark.parametrize(("p", "m"), [(2, 6), (4, 8), (5, 11), (8, 20)])
def test_peak_activation_bounds(p, m):
    """1F1B: p - r on rank r; ZB-H1: p (1F1B's peak); ZB-H2: 2p - 1; ZB-V: 2p half-size stages; GPipe: m."""
    assert simulate(build_schedule("1f1b", p, m)).peak_activations == tuple(p - r for r in range(p))
    assert max(simulate(build_schedule("zb-h1", p, m)).peak_activations) == p
    assert max(simulate(build_schedule("zb-h2", p, m)).peak_activations) == min(2 * p - 1, m)
    assert max(simulate(build_schedule("zbv", 2 * p, m)).peak_activations) <= 2 * p
    assert simulate(build_schedule("gpipe", p, m)).peak_activations == (m,) * p


@pytest.mark.parametrize(
    ("name", "n_stages", "m", "options", "match"),
    [
        ("nope", 4, 4, {}, "unknown schedule 'nope'"),
        ("1f1b", 0, 4, {}, "n_stages must be an integer >= 1"),
        ("1f1b", 4, 0, {}, "n_microbatches must be an integer >= 1"),
        ("zb-h1", 4, 2.5, {}, "n_microbatches must be an integer"),
        ("zb-h1", True, 2, {}, "n_stages must be an integer"),
        ("1f1b", 4, 4, {"stages_per_rank": 2}, "does not take option"),
        ("zbv", 5, 4, {}, "n_stages must be even"),
        ("dualpipev", 7, 8, {}, "n_stages must be even"),
        ("dualpipev", 8, 7, {}, "at least as many microbatches as stages"),
        ("interleaved-1f1b", 9, 4, {}, "multiple of stages_per_rank"),
        ("interleaved-1f1b", 8, 6, {}, "multiple of the number of ranks"),
        ("interleaved-1f1b", 4, 4, {"stages_per_rank": 1}, "stages_per_rank >= 2"),
        ("zb-auto", 4, 4, {"memory_limit": 0}, "memory_limit"),
        ("zb-auto", 4, 4, {"f": [1, 2]}, "one cost per stage"),
    ],
)
def test_impossible_arguments_raise_clear_errors(name, n_stages, m, options, match):
    with pytest.raises(ValueError, match=match):
        build_schedule(name, n_stages, m, **options)


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb-h1", "zb-h2", "interleaved-1f1b"])
def test_messages_between_two_ranks_arrive_in_sending_order(name):
    """These families need no message tags: each rank consumes a peer's messages in the order they were sent."""
    s = build_schedule(name, 8 if name == "interleaved-1f1b" else 4, 8)
    validate(s, ordered_channels=True)


def test_zbv_needs_tagged_messages():
    """ZB-V interleaves activations and gradients on one rank pair out of order; report it when asked."""
    s = build_schedule("zbv", 8, 8)
    validate(s)
    problems = channel_order_problems(s)
    assert problems and "rank" in problems[0]
    with pytest.raises(ScheduleError, match="out-of-order channels"):
        validate(s, ordered_channels=True)


GOLDEN = {
    "gpipe_p3_m4.txt": ("gpipe", 3, 4, {}),
    "1f1b_p4_m6.txt": ("1f1b", 4, 6, {}),
    "1f1b_split_p3_m3.txt": ("1f1b", 3, 3, {"split_backward": True}),
    "interleaved_p2_v2_m4.txt": ("interleaved-1f1b", 4, 4, {}),
    "zb_h1_p4_m8.txt": ("zb-h1", 4, 8, {}),
    "zb_h2_p4_m8.txt": ("zb-h2", 4, 8, {}),
    "zbv_p3_m6.txt": ("zbv", 6, 6, {}),
    "dualpipev_p2_m5.txt": ("dualpipev", 4, 5, {}),
    "v_half_p4_m8.txt": ("v-half", 8, 8, {}),
    "v_min_p3_m6.txt": ("v-min", 6, 6, {}),
}


@pytest.mark.parametrize("filename", sorted(GOLDEN))
def test_golden_schedules(filename):
    """Reviewed schedules, kept as text (with their unit-cost picture) so any change shows up in a diff.

    Regenerate after an intended change with ``SPLITGRAD_UPDATE_GOLDEN=1`` and review the diff.
    """
    name, n_stages, m, options = GOLDEN[filename]
    text = golden_text(build_schedule(name, n_stages, m, **options))
    path = GOLDEN_DIR / filename
    if os.environ.get("SPLITGRAD_UPDATE_GOLDEN"):
        path.write_text(text)
    assert path.read_text() == text
