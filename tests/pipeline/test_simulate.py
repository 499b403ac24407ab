"""The simulator against an independent reference, and its invariants over random costs (hypothesis).

Why: every bubble number, the zb-auto choice and the pictures come from the simulator; it must implement
exactly the blocking semantics (an action starts when its rank is free and its inputs have arrived) for any
costs, placements and orders, not only for the unit-cost schedules the closed forms cover.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from splitgrad.pipeline import ActionKind, build_schedule, simulate, validate
from splitgrad.pipeline.schedules import schedule_names
from tests.pipeline.helpers import random_valid_schedule, reference_times

F, B, W, BW = ActionKind.F, ActionKind.B, ActionKind.W, ActionKind.BW

costs = st.floats(min_value=0.05, max_value=5.0, allow_nan=False)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**32 - 1),
    n_stages=st.integers(1, 6),
    m=st.integers(1, 5),
    comm=st.sampled_from([0.0, 0.3, 1.7]),
)
def test_matches_reference_on_random_valid_schedules(seed, n_stages, m, comm):
    rng = random.Random(seed)
    n_ranks = rng.randint(1, n_stages)
    schedule = random_valid_schedule(rng, n_stages, n_ranks, m)
    f = [rng.uniform(0.1, 3) for _ in range(n_stages)]
    b = [rng.uniform(0.1, 3) for _ in range(n_stages)]
    w = [rng.uniform(0.0, 3) for _ in range(n_stages)]
    validate(schedule)
    result = simulate(schedule, f, b, w, comm)
    expected = reference_times(schedule, f, b, w, comm)
    for r in range(n_ranks):
        flat = [t for pair in expected[r] for t in pair]
        assert [t for pair in zip(result.starts[r], result.ends[r]) for t in pair] == pytest.approx(
            flat, abs=1e-9
        )


def test_reference_comparison_is_not_trivial():
    """A different comm latency gives different times: the comparison above can fail."""
    rng = random.Random(3)
    schedule = random_valid_schedule(rng, 4, 4, 3)
    ones = [1.0] * 4
    with_comm = reference_times(schedule, ones, ones, ones, 0.5)
    without = simulate(schedule)
    assert any(list(zip(without.starts[r], without.ends[r])) != with_comm[r] for r in range(4))


def _check_invariants(schedule, result, f, b, w, comm):
    n = schedule.n_stages
    end = {}
    for r, acts in enumerate(schedule.rank_actions):
        for a, hi in zip(acts, result.ends[r]):
            for s, k, i in a.parts:
                end[(s, k, i)] = hi
    for r, acts in enumerate(schedule.rank_actions):
        prev_end = 0.0
        for a, lo, hi in zip(acts, result.starts[r], result.ends[r]):
            cost, deps = 0.0, []
            for s, k, i in a.parts:  # an overlapped pair costs its parts' sum (overlap=0) and waits for both
                cost += {F: f[s], B: b[s], W: w[s], BW: b[s] + w[s]}[k]
                if k is F and s > 0:
                    deps.append((end[(s - 1, F, i)], schedule.rank_of(s - 1) != r))
                if k in (B, BW):
                    deps.append((end[(s, F, i)], False))
                    if s < n - 1:
                        g = end.get((s + 1, B, i), end.get((s + 1, BW, i)))
                        deps.append((g, schedule.rank_of(s + 1) != r))
                if k is W:
                    deps.append((end[(s, B, i)], False))
            assert hi - lo == pytest.approx(cost)
            ready = max([prev_end] + [d + (comm if cross else 0.0) for d, cross in deps])
            assert lo == pytest.approx(ready, abs=1e-9)  # as soon as possible, never earlier
            prev_end = hi
    spans = [hi - lo for lo, hi in result.rank_spans]
    for r, span in enumerate(spans):
        assert span >= result.rank_work[r] - 1e-9
        busy = sum(hi - lo for lo, hi in zip(result.starts[r], result.ends[r]))
        assert busy == pytest.approx(result.rank_work[r])
    assert 0.0 <= result.bubble_ratio < 1.0
    assert result.makespan >= max(spans) - 1e-9


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    name=st.sampled_from([n for n in schedule_names() if n != "zb-auto"]),
    p=st.integers(1, 4),
    extra=st.integers(0, 6),
    data=st.data(),
    comm=st.sampled_from([0.0, 0.25]),
)
def test_named_schedules_under_random_costs(name, p, extra, data, comm):
    n_stages = 2 * p if name in ("zbv", "zbv-auto", "dualpipev", "interleaved-1f1b", "v-half", "v-min") else p
    m = (extra + 1) * p if name == "interleaved-1f1b" else 2 * p + extra if name == "dualpipev" else 1 + extra
    schedule = build_schedule(name, n_stages, m)
    f = data.draw(st.lists(costs, min_size=n_stages, max_size=n_stages))
    b = data.draw(st.lists(costs, min_size=n_stages, max_size=n_stages))
    w = data.draw(st.lists(costs, min_size=n_stages, max_size=n_stages))
    result = simulate(schedule, f, b, w, comm)
    _check_invariants(schedule, result, f, b, w, comm)
    # Memory depends on the order only, never on the costs.
    assert result.peak_activations == simulate(schedule).peak_activations


def test_comm_delays_cross_rank_inputs_only():
    s = build_schedule("zbv", 4, 3)
    base, slow = simulate(s), simulate(s, comm=0.5)
    # Rank 1 runs stage 1 then stage 2 for microbatch 0 back to back: the V's turn is local (no comm).
    names = [a.name for a in s.rank_actions[1]]
    j1, j2 = names.index("1F0"), names.index("2F0")
    assert slow.starts[1][j1] == base.starts[1][j1] + 0.5  # 0F0 -> 1F0 crosses ranks
    end_1f0 = slow.ends[1][j1]
    assert slow.starts[1][j2] == max(end_1f0, slow.ends[1][j2 - 1])  # 1F0 -> 2F0 is local: no latency
    assert slow.makespan > base.makespan


def test_stage_spans_and_events():
    s = build_schedule("zbv", 4, 3)
    result = simulate(s, comm=0.1)
    assert len(result.stage_spans) == 4
    events = result.events()
    compute = [e for e in events if e.kind != "comm"]
    comm = [e for e in events if e.kind == "comm"]
    assert len(compute) == s.n_actions
    # One transfer per cross-rank edge and microbatch, each direction: stages 0->1, 2->3 cross ranks.
    assert len(comm) == 2 * 2 * 3
    assert all(e.end - e.start == pytest.approx(0.1) for e in comm)
    assert min(lo for lo, _ in result.stage_spans) == 0.0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"f": -1.0}, "f costs must be finite and >= 0"),
        ({"b": [1.0, 2.0]}, "b needs one cost per stage"),
        ({"w": float("nan")}, "w costs must be finite"),
        ({"comm": -0.1}, "comm must be finite and >= 0"),
    ],
)
def test_bad_costs_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        simulate(build_schedule("1f1b", 3, 3), **kwargs)


def test_zero_costs_give_zero_bubble():
    result = simulate(build_schedule("1f1b", 3, 3), 0.0, 0.0, 0.0)
    assert result.makespan == 0.0 and result.bubble_ratio == 0.0
