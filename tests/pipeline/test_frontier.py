"""The memory-bubble frontier: every family's point, in one unit, and the Pareto front among them.

Why: a user picks a schedule from this table; a point in the wrong unit (a V stage's activation counted as a
whole rank's) or a dominated point marked optimal sends them to the wrong schedule. The points are checked
against the families simulated directly, and the front against an independent dominance test.
"""

from __future__ import annotations

import pytest

from splitgrad.pipeline import build_schedule, simulate
from splitgrad.pipeline.schedules import FrontierPoint, frontier
from splitgrad.pipeline.schedules.frontier import _mark_pareto
from splitgrad.pipeline.schedules.v_min import v_min_peak
from tests.pipeline.test_cli import _run as main

P, M = 3, 6
COSTS = dict(f=1.0, b=1.5, w=0.5)


@pytest.fixture(scope="module")
def front():
    return frontier(P, M, **COSTS, comm=0.1)


def test_every_family_has_a_point_in_rank_units(front):
    labels = {pt.label for pt in front.points}
    assert {"gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zbv", "dualpipev", "v-half", "v-min",
            "zb-auto", "zbv-auto"} <= labels  # fmt: skip
    by = {pt.label: pt for pt in front.points}
    # One unit for all: a rank's layers' activation of one microbatch. 1F1B holds p of them, GPipe m, the V
    # families half a unit per V-stage activation.
    assert by["1f1b"].peak_memory == P and by["gpipe"].peak_memory == M
    assert by["v-min"].peak_memory == v_min_peak(P) / 2
    assert by["zbv"].peak_memory == P
    # Costs are per rank's layers: a V stage costs half, so zbv's makespan is the simulation at halved costs.
    zbv = simulate(build_schedule("zbv", 2 * P, M), 0.5, 0.75, 0.25, 0.1)
    assert by["zbv"].makespan == pytest.approx(zbv.makespan) and by["zbv"].bubble_ratio == zbv.bubble_ratio
    one = simulate(build_schedule("1f1b", P, M), 1.0, 1.5, 0.5, 0.1)
    assert by["1f1b"].bubble_ratio == one.bubble_ratio
    mem = [pt.peak_memory for pt in front.points]
    assert mem == sorted(mem)


def test_pareto_front_is_exactly_the_undominated_points(front):
    for pt in front.points:
        beaten = any(
            o.peak_memory <= pt.peak_memory and o.step_bubble <= pt.step_bubble
            and (o.peak_memory < pt.peak_memory or o.step_bubble < pt.step_bubble)
            for o in front.points
        )  # fmt: skip
        assert pt.pareto is not beaten, pt
    assert front.pareto and front.pareto[0].peak_memory == min(pt.peak_memory for pt in front.points)
    # Not trivially passing: a point worse on both axes is marked off the front.
    marked = _mark_pareto(
        [FrontierPoint("a", 1, 1.0, 0.5, 1.0, 0.5), FrontierPoint("b", 1, 2.0, 0.6, 1.0, 0.6)]
    )
    assert [x.pareto for x in marked] == [True, False]
    # The front is on the step bubble, not the paper's ratio: "b" is ahead on the latter only.
    marked = _mark_pareto(
        [FrontierPoint("a", 1, 1.0, 0.5, 1.0, 0.2), FrontierPoint("b", 1, 2.0, 0.1, 1.2, 0.3)]
    )
    assert [x.pareto for x in marked] == [True, False]


def test_step_bubble_is_the_idle_share_of_the_step(front):
    work = M * sum(COSTS.values())  # per rank, in every family (a V stage costs half, twice)
    for pt in front.points:
        assert pt.step_bubble == pytest.approx(1 - work / pt.makespan), pt
        # The paper's ratio leaves out the wait for the first input, so it is never the larger.
        assert pt.bubble_ratio <= pt.step_bubble + 1e-12, pt


def test_bytes_table_png_and_skipped(tmp_path):
    fr = frontier(2, 3, activation_bytes=2**20, w_memory=0.5)
    by = {pt.label: pt for pt in fr.points}
    assert by["1f1b"].peak_memory == 2 * 2**20  # p = 2 activations of 1 MiB
    skipped = dict(fr.skipped)
    assert "interleaved-1f1b" in skipped and "multiple of the number of ranks" in skipped["interleaved-1f1b"]
    assert "dualpipev" in skipped
    table = fr.to_table()
    assert "peak memory (MiB)" in table and "| 1f1b | 1 | 2.00 |" in table
    assert fr.save_png(tmp_path / "front.png").stat().st_size > 0
    with pytest.raises(ValueError, match="n_ranks"):
        frontier(0, 4)
    with pytest.raises(ValueError, match="w_memory"):
        frontier(2, 4, w_memory=2.0)


def test_cli(capsys, tmp_path):
    code = main(["schedule", "--frontier", "--ranks", "2", "--microbatches", "4", "--w", "0.5", "--png",
                 str(tmp_path / "f")])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0, out
    assert "Pareto front: " in out and "| v-min | 2 |" in out and (tmp_path / "f.png").exists()
    assert main(["schedule", "1f1b", "--frontier"]) == 2
    assert "not both" in capsys.readouterr().err
    assert main(["schedule", "--frontier", "--f", "1,2"]) == 2
    assert "one cost per rank" in capsys.readouterr().err
