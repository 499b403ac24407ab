"""Gradient-sync points as data: the add_grad_sync pass, their validation, simulation, text form and goldens.

Why: the runtime starts and finishes data-parallel reductions exactly where these points sit, so they must be
placed where every forward has counted its gradient contributions (``R``) and after every gradient has
arrived (``RF``); a misplaced point would start a reduction early (a gradient lost to it) or never finish it.
"""

from __future__ import annotations

import os

import pytest

from splitgrad.pipeline import Action, ActionKind, Schedule, ScheduleError, build_schedule, simulate, validate
from splitgrad.pipeline.ir.actions import parse_action
from splitgrad.pipeline.passes import add_grad_sync, has_grad_sync, strip_grad_sync
from tests.pipeline.helpers import GOLDEN_DIR, golden_text

F, B, W, BW, R, RF = (ActionKind.F, ActionKind.B, ActionKind.W, ActionKind.BW, ActionKind.R, ActionKind.RF)

FAMILIES = [
    ("1f1b", 3, 5, {}),
    ("1f1b", 3, 5, {"split_backward": True}),
    ("interleaved-1f1b", 4, 4, {}),
    ("zb-h1", 4, 8, {}),
    ("zb-h2", 4, 8, {}),
    ("zbv", 6, 6, {}),
    ("dualpipev", 4, 5, {}),
    ("zb-auto", 3, 6, {"f": 1.0, "b": 1.2, "w": 0.7}),
]


@pytest.mark.parametrize(("name", "n_stages", "m", "options"), FAMILIES)
def test_pass_places_one_r_and_one_rf_per_stage(name, n_stages, m, options):
    base = build_schedule(name, n_stages, m, **options)
    lowered = add_grad_sync(base)
    validate(lowered)
    assert has_grad_sync(lowered) and not has_grad_sync(base)
    assert strip_grad_sync(lowered) == base
    for r, acts in enumerate(lowered.rank_actions):
        for s in lowered.stages_of(r):
            r_pos = [j for j, a in enumerate(acts) if a == Action(s, R, None)]
            rf_pos = [j for j, a in enumerate(acts) if a == Action(s, RF, None)]
            assert len(r_pos) == 1 and len(rf_pos) == 1, (name, s)
            parts = [
                (j, p)
                for j, a in enumerate(acts)
                for p in a.parts
                if p.stage == s and p.microbatch is not None
            ]
            last_backward = max(j for j, p in parts if p.kind in (B, BW))
            assert r_pos[0] <= last_backward, "R must come before (or with) the stage's last input gradient"
            assert all(j < r_pos[0] or p.kind is not F for j, p in parts), "R before a forward of its stage"
            assert rf_pos[0] > max(j for j, _ in parts)
        # RF points close the rank's list: no compute after them.
        tail = [a.kind for a in acts[-len(lowered.stages_of(r)) :]]
        assert tail == [RF] * len(lowered.stages_of(r))
    # Lowering is idempotent: existing points are replaced, not duplicated.
    assert add_grad_sync(lowered) == lowered


def test_sync_points_cost_only_at_rf_and_simulate_like_the_base():
    base = build_schedule("zb-h1", 4, 8)
    lowered = add_grad_sync(base)
    plain, free = simulate(base, 1.0, 1.0, 1.0, 0.1), simulate(lowered, 1.0, 1.0, 1.0, 0.1)
    assert free.rank_spans == plain.rank_spans and free.bubble_ratio == plain.bubble_ratio
    costly = simulate(lowered, 1.0, 1.0, 1.0, 0.1, sync=[0.5, 0.25, 0.0, 2.0])
    for r, ((lo, hi), (lo0, hi0)) in enumerate(zip(costly.rank_spans, plain.rank_spans)):
        assert lo == lo0 and hi == pytest.approx(hi0 + [0.5, 0.25, 0.0, 2.0][r])
    assert costly.bubble_ratio > plain.bubble_ratio
    kinds = {e.kind for e in costly.events()}
    assert {"R", "RF"} <= kinds
    rf = [e for e in costly.events() if e.kind == "RF" and e.rank == 3]
    assert len(rf) == 1 and rf[0].end - rf[0].start == pytest.approx(2.0)
    trace = costly.to_chrome_trace()
    assert any(ev.get("name") == "3RF" for ev in trace["traceEvents"])


def test_sync_point_string_and_text_forms_round_trip():
    assert str(Action(0, R, None)) == "0R" and str(Action(12, RF, None)) == "12RF"
    assert parse_action("0R") == Action(0, R, None) and parse_action(" 3RF ") == Action(3, RF, None)
    for bad in ("0R1", "R", "0RF2", "0FR"):
        with pytest.raises(ValueError, match="cannot parse action"):
            parse_action(bad)
    lowered = add_grad_sync(build_schedule("zbv", 4, 4))
    assert Schedule.from_text(lowered.to_text()) == lowered


def _with(schedule: Schedule, rank: int, actions: list) -> Schedule:
    lists = list(schedule.rank_actions)
    lists[rank] = tuple(actions)
    return Schedule(schedule.name, schedule.n_microbatches, schedule.stage_to_rank, lists)


def test_misplaced_sync_points_are_rejected():
    lowered = add_grad_sync(build_schedule("1f1b", 2, 3, split_backward=True))
    acts = list(lowered.rank_actions[0])
    # R moved to the front: before stage 0's forwards.
    early = [Action(0, R, None)] + [a for a in acts if a != Action(0, R, None)]
    with pytest.raises(ScheduleError, match=r"0R \(position 0\) comes before stage 0's last forward"):
        validate(_with(lowered, 0, early))
    # RF moved before the last W.
    no_rf = [a for a in acts if a != Action(0, RF, None)]
    late_w = [*no_rf[:-1], Action(0, RF, None), no_rf[-1]]
    with pytest.raises(ScheduleError, match=r"0RF .* comes before stage 0's last compute action"):
        validate(_with(lowered, 0, late_w))
    with pytest.raises(ScheduleError, match="0RF appears 2 times"):
        validate(_with(lowered, 0, [*acts, Action(0, RF, None)]))
    with pytest.raises(ScheduleError, match="takes no microbatch"):
        validate(_with(lowered, 0, [*acts[:-1], Action(0, RF, 2)]))
    with pytest.raises(ScheduleError, match="belongs to rank 1"):
        validate(_with(lowered, 0, [*acts, Action(1, R, None)]))
    with pytest.raises(ValueError, match=r"stages \[5\] outside"):
        add_grad_sync(lowered, {5})


def test_pass_on_a_subset_of_stages():
    lowered = add_grad_sync(build_schedule("zb-h1", 3, 4), {1})
    sync = [a for acts in lowered.rank_actions for a in acts if a.microbatch is None]
    assert sync == [Action(1, R, None), Action(1, RF, None)]


GOLDEN_LOWERED = {
    "zb_h1_sync_p3_m4.txt": ("zb-h1", 3, 4),
    "zbv_sync_p2_m4.txt": ("zbv", 4, 4),
}


@pytest.mark.parametrize("filename", sorted(GOLDEN_LOWERED))
def test_golden_lowered_schedules(filename):
    """Reviewed lowered schedules (``SPLITGRAD_UPDATE_GOLDEN=1`` regenerates; review the diff)."""
    name, n_stages, m = GOLDEN_LOWERED[filename]
    text = golden_text(add_grad_sync(build_schedule(name, n_stages, m)))
    path = GOLDEN_DIR / filename
    if os.environ.get("SPLITGRAD_UPDATE_GOLDEN"):
        path.write_text(text)
    assert path.read_text() == text
