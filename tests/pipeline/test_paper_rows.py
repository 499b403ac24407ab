"""zb-auto under the paper's memory model against the Zero Bubble paper's published bubble rates.

Why: the paper (Qi et al., ICLR 2024, arXiv 2401.10241) reports ZB-1p and ZB-2p bubble rates for 12 settings
with profiled costs (Table 9); with its memory model (``B`` keeps ``M_W = 32h`` of ``M_B = 34h + 5as``) zb-auto
must plan schedules at least as good within the same memory, or the planner has regressed.
"""

from __future__ import annotations

import pytest

from splitgrad.pipeline import build_schedule, simulate
from splitgrad.pipeline.schedules import auto_candidates

SHAPES = {"1.5B": (2304, 24), "6.2B": (4096, 32), "14.6B": (5120, 40), "28.3B": (6144, 48)}
# (model, p, m, F, B, W, comm, published ZB-1p, published ZB-2p)
ROWS = [
    ("1.5B", 8, 24, 18.522, 18.086, 9.337, 0.601, 0.1585, 0.0433),
    ("1.5B", 8, 32, 18.513, 18.086, 9.331, 0.626, 0.1242, 0.0039),
    ("1.5B", 8, 64, 18.546, 18.097, 9.321, 0.762, 0.0674, 0.0026),
    ("6.2B", 8, 24, 29.718, 29.444, 19.927, 0.527, 0.1323, 0.0029),
    ("6.2B", 8, 32, 29.802, 29.428, 19.530, 0.577, 0.1045, 0.0022),
    ("6.2B", 8, 64, 29.935, 29.621, 19.388, 0.535, 0.0554, 0.0010),
    ("14.6B", 16, 48, 11.347, 11.248, 8.132, 0.377, 0.1397, 0.0066),
    ("14.6B", 16, 64, 11.307, 11.254, 8.101, 0.379, 0.1088, 0.0054),
    ("14.6B", 16, 128, 11.325, 11.308, 8.109, 0.378, 0.0576, 0.0028),
    ("28.3B", 32, 96, 10.419, 10.207, 7.715, 0.408, 0.1421, 0.0038),
    ("28.3B", 32, 128, 10.408, 10.204, 7.703, 0.408, 0.1106, 0.0029),
    ("28.3B", 32, 256, 10.402, 10.248, 7.698, 0.460, 0.0594, 0.0018),
]


def w_memory_of(model: str) -> float:
    h, a = SHAPES[model]
    return 32 * h / (34 * h + 5 * a * 1024)


def _ids(row):
    return f"{row[0]}-p{row[1]}-m{row[2]}"


@pytest.mark.parametrize("row", ROWS, ids=_ids)
@pytest.mark.parametrize("limit", ["p", "2p"])
def test_zb_auto_reaches_the_published_zb_schedules(row, limit):
    model, p, m, f, b, w, comm, zb1p, zb2p = row
    r = w_memory_of(model)
    memory = p if limit == "p" else 2 * p
    sched = build_schedule("zb-auto", p, m, f=f, b=b, w=w, comm=comm, memory_limit=memory, w_memory=r)
    result = simulate(sched, f, b, w, comm, w_memory=r)
    assert max(result.peak_memory) <= memory + 1e-9, "the plan breaks its memory limit"
    if limit == "p":
        assert result.bubble_ratio <= zb1p + 1e-4  # equal to the paper's ZB-1p to 4 decimals
    else:
        assert result.bubble_ratio <= zb2p + 0.002  # the bound: published ZB-2p + 0.002
    # Not trivially passing: the memory model matters — with W holding the whole activation (w_memory=1) the
    # same budget gives a worse plan in these settings (the 9 % of the issue).
    if limit == "2p" and (model, p, m) == ("6.2B", 8, 24):
        old = build_schedule("zb-auto", p, m, f=f, b=b, w=w, comm=comm, memory_limit=memory)
        assert simulate(old, f, b, w, comm).bubble_ratio > zb2p + 0.01


def test_a_weakened_search_misses_the_bound():
    """Not trivially passing: without the guard tuning (the greedy passes alone), the p=32 m=256 row misses
    the issue's bound that the full search meets, so the bound above is tight enough to catch a regression."""
    model, p, m, f, b, w, comm, _, zb2p = ROWS[-1]
    r = w_memory_of(model)
    kwargs = dict(f=f, b=b, w=w, comm=comm, memory_limit=2 * p, w_memory=r)
    candidates = auto_candidates(p, m, **kwargs)
    full = candidates[0]
    weak = next(c for c in candidates if "w_guard" not in c.label)  # = auto_candidates(..., tune=False)[0]
    assert weak.result.bubble_ratio > zb2p + 0.002
    assert full.result.bubble_ratio <= zb2p + 0.002
    assert "w_guard" in full.label and "w_guard" not in weak.label


def test_memory_model_counts_what_b_keeps():
    sched = build_schedule("zb-h1", 4, 8)
    full = simulate(sched)
    part = simulate(sched, w_memory=0.4)
    assert full.peak_memory == tuple(float(x) for x in full.peak_activations)
    # ZB-H1 rank r defers its first r W's: at its peak it holds p - r activations whole and r kept for W.
    assert part.peak_memory == pytest.approx([(4 - r) + 0.4 * r for r in range(4)])
    assert part.peak_activations == full.peak_activations == (4, 4, 4, 4)
    with pytest.raises(ValueError, match="w_memory"):
        simulate(sched, w_memory=1.5)
    with pytest.raises(ValueError, match="w_memory"):
        build_schedule("zb-auto", 4, 8, w_memory=-0.1)
