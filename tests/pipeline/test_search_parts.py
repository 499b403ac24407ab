"""The pieces zb-auto and zbv-auto share: the list scheduler, its memory-model ledger, the search driver.

Why: both planners run one event loop (:func:`list_schedule`) over one :class:`PassState`, with one
:class:`PlanCosts`, and their settings through one :class:`GreedySearch`; a slip there (a ``W`` freeing the
wrong amount, a rank looked at too late or twice, a pass run under other costs than the pool simulates, a
stalled pass kept) would corrupt every plan of both, so each is pinned here on its own.
"""

from __future__ import annotations

import pytest

from splitgrad.pipeline import ActionKind, build_schedule, simulate
from splitgrad.pipeline.schedules._candidates import CandidatePool
from splitgrad.pipeline.schedules._common import check_choice, check_v_shape
from splitgrad.pipeline.schedules._list_scheduler import PassState, PlanCosts, Run, Wait, list_schedule
from splitgrad.pipeline.schedules._search import GreedySearch

F, B, W = ActionKind.F, ActionKind.B, ActionKind.W


def test_pass_state_follows_the_memory_model():
    """``F`` holds 1, ``B`` frees ``1 - w_memory`` and queues its ``W``, ``W`` (oldest first) frees the rest."""
    r_w = 0.25
    costs = PlanCosts((1.0, 2.0), (3.0, 4.0), (5.0, 6.0), 0.0, r_w)
    state = PassState(2, 1, 2, costs)  # two stages on one rank
    steps = [(F, 0, 0.0), (F, 1, 1.0), (B, 1, 3.0), (B, 0, 7.0), (W, -1, 10.0), (W, -1, 16.0)]
    ends, live = [], []
    for kind, s, t in steps:
        stage, end = state.run(0, kind, s, t)
        ends.append((stage, end))
        live.append(state.live[0])
    # The first W is stage 1's (its B ran first), at stage 1's W cost.
    assert ends == [(0, 1.0), (1, 3.0), (1, 7.0), (0, 10.0), (1, 16.0), (0, 21.0)]
    assert live == [1.0, 2.0, 1.25, 0.5, 0.25, 0.0]
    assert [str(a) for a in state.actions[0]] == ["0F0", "1F0", "1B0", "0B0", "1W0", "0W0"]
    assert state.fend == [[1.0, float("inf")], [3.0, float("inf")]]
    assert state.bend == [[10.0, float("inf")], [7.0, float("inf")]]
    assert state.nf == [1, 1] and state.nb == [1, 1] and state.free == [21.0]
    assert not state.pending[0] and state.last_was_f == [False]
    # Not trivially passing: the same steps with W holding the whole activation leave memory held after B.
    whole = PassState(2, 1, 2, PlanCosts((1.0, 2.0), (3.0, 4.0), (5.0, 6.0), 0.0, 1.0))
    for kind, s, t in steps[:4]:
        whole.run(0, kind, s, t)
    assert whole.live[0] == 2.0 != live[3]


def test_greedy_search_runs_every_pass_under_the_pools_problem():
    """A pass gets the pool's shape, costs, limits and w_memory; a stalled pass (None) is dropped; the best
    greedy candidate ignores candidates added another way."""
    seen = []

    def fake_pass(n_stages, n_microbatches, **kwargs):
        seen.append((n_stages, n_microbatches, kwargs))
        if kwargs.get("stall"):
            return None
        return build_schedule(
            "1f1b" if kwargs["fast"] else "gpipe", n_stages, n_microbatches, split_backward=True
        )

    costs = PlanCosts.of("test", 3, f=1.0, b=2.0, w=0.5, comm=0.1, w_memory=0.5)
    pool = CandidatePool(costs, (8.0, 8.0, 8.0))
    search = GreedySearch(fake_pass, 3, 6, pool)
    assert search.greedy("slow", fast=False) is not None
    assert search.greedy("stalled", fast=True, stall=True) is None
    assert search.greedy("fast", fast=True) is not None
    problem = dict(
        f=(1.0,) * 3, b=(2.0,) * 3, w=(0.5,) * 3, comm=0.1, memory_limit=(8.0, 8.0, 8.0), w_memory=0.5
    )
    assert seen == [
        (3, 6, {**problem, "fast": False}),
        (3, 6, {**problem, "fast": True, "stall": True}),
        (3, 6, {**problem, "fast": True}),
    ]
    assert [c.label for c in pool.ranked()] == ["fast", "slow"]
    assert search.settings == {
        "slow": {"fast": False},
        "stalled": {"fast": True, "stall": True},
        "fast": {"fast": True},
    }
    expected = simulate(pool.ranked()[0].schedule, 1.0, 2.0, 0.5, 0.1, w_memory=0.5)
    assert pool.ranked()[0].result.makespan == expected.makespan
    # A better schedule that no greedy run made is not the best *greedy* candidate.
    pool.consider("hand-written", build_schedule("zb-h1", 3, 6))
    assert pool.ranked()[0].label == "hand-written"
    assert search.best_greedy() is not None and search.best_greedy().label == "fast"
    # Not trivially passing: a pool whose limit the 1F1B plan exceeds keeps only what fits.
    unit = PlanCosts.of("test", 3, f=1.0, b=1.0, w=1.0, comm=0.0, w_memory=1.0)
    tight = GreedySearch(fake_pass, 3, 6, CandidatePool(unit, (2.0, 2.0, 2.0)))
    assert tight.greedy("fast", fast=True) is None and tight.best_greedy() is None


def test_shared_argument_checks_name_the_schedule_and_value():
    check_choice("zbv-auto", "fill", "fit", ("eager", "fit"))
    with pytest.raises(
        ValueError, match=r"^zb-auto: fill must be 'eager', 'fit' or 'reserve', got fill='lazy'$"
    ):
        check_choice("zb-auto", "fill", "lazy", ("eager", "fit", "reserve"))
    check_v_shape("zbv", 4, 1)
    with pytest.raises(
        ValueError, match=r"^dualpipev places two stages per rank in a V, so n_stages must be even"
    ):
        check_v_shape("dualpipev", 5, 4)
    with pytest.raises(
        ValueError, match=r"^zbv-auto: n_microbatches must be an integer >= 1, got n_microbatches=0$"
    ):
        check_v_shape("zbv-auto", 4, 0)


class _Chain:
    """A toy planner on ``p`` ranks, one stage each: ``F`` when its input is there, then ``B``, then ``W``;
    it records every look (rank, time) the loop gives it."""

    def __init__(self, p: int, fifo_ties: bool, wake_idle_only: bool) -> None:
        self.p, self.fifo_ties, self.wake_idle_only, self.looks = p, fifo_ties, wake_idle_only, []

    def choose(self, st, r, t):
        self.looks.append((r, t))
        if st.nf[r] == 0:
            ready = 0.0 if r == 0 else st.fend[r - 1][0]
        elif st.nb[r] == 0:
            ready = st.fend[r][0] if r == self.p - 1 else st.bend[r + 1][0]
        else:
            return Run(W, r) if st.pending[r] else Wait(None, False)
        if ready <= t:
            return Run(F if st.nf[r] == 0 else B, r)
        return Wait(ready if ready < float("inf") else None, True)

    def consumer(self, st, kind, s, start, end):
        c = s + 1 if kind is F else s - 1 if kind is B else -1
        return (c, end if not self.wake_idle_only else start) if 0 <= c < self.p else None


@pytest.mark.parametrize(("fifo", "idle_only"), [(True, True), (False, False)])
def test_list_schedule_runs_a_chain_to_the_end(fifo, idle_only):
    """One microbatch down three ranks and back: every rank runs F, B, W, each when its input is there."""
    planner = _Chain(3, fifo, idle_only)
    costs = PlanCosts.of("test", 3, f=1.0, b=2.0, w=1.0, comm=0.0, w_memory=1.0)
    state = PassState(3, 3, 1, costs)
    assert list_schedule(planner, state)
    assert [[str(a) for a in acts] for acts in state.actions] == [
        ["0F0", "0B0", "0W0"],
        ["1F0", "1B0", "1W0"],
        ["2F0", "2B0", "2W0"],
    ]
    assert state.fend == [[1.0], [2.0], [3.0]] and state.bend == [[9.0], [7.0], [5.0]]
    # Each rank is looked at in time order, never twice at once (a superseded look in the heap is skipped).
    for r in range(3):
        times = [t for rr, t in planner.looks if rr == r]
        assert times == sorted(times) and len(set(times)) == len(times)


def test_list_schedule_reports_a_stalled_pass():
    """A planner that never lets rank 1 run: the loop ends (nothing queued) and says the pass is incomplete."""

    class Stuck(_Chain):
        def choose(self, st, r, t):
            return Wait(None, False) if r == 1 else super().choose(st, r, t)

    state = PassState(2, 2, 1, PlanCosts.of("test", 2, f=1.0, b=1.0, w=1.0, comm=0.0, w_memory=1.0))
    assert not list_schedule(Stuck(2, True, True), state)
    assert [len(acts) for acts in state.actions] == [1, 0]
