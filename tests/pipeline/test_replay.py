"""replay_measured / overhead_split: a measured step replayed at its own per-action durations.

Why: the runtime's gap to the simulator mixes its own overhead with compute jitter; the replay removes the
jitter (same engine as simulate, each action at its measured duration), and the split must attribute what is
left to dispatch, transport and waits propagated from other ranks, adding up exactly. The numbers below are
derived by hand from the timeline drawn in the comments.
"""

from __future__ import annotations

import pytest

from splitgrad.pipeline import build_schedule, simulate
from splitgrad.pipeline.passes import add_grad_sync
from splitgrad.pipeline.timeline import TimelineEvent, overhead_split, replay_measured


def _ev(rank: int, name: str, start: float, end: float) -> TimelineEvent:
    if name.startswith("recv"):
        return TimelineEvent(rank, name, start, end, "comm")
    stage, kind, mb = int(name[0]), name[1:-1], int(name[-1])
    return TimelineEvent(rank, name, start, end, kind, stage, mb)


# zb-h1, 2 stages, 2 microbatches. Rank 0: 0F0 0F1 0B0 0W0 0B1 0W1; rank 1: 1F0 1B0 1F1 1B1 1W0 1W1.
EVENTS = [
    _ev(0, "0F0", 0.0, 1.0),
    _ev(0, "0F1", 1.2, 2.2),  # 0.2 idle, no input needed: dispatch
    _ev(0, "recv grad 0B0", 2.2, 3.8),
    _ev(0, "0B0", 3.9, 4.9),  # 1B0 ends 3.5: 1.3 producer wait, then 0.3 in the receive, 0.1 dispatch
    _ev(0, "0W0", 4.9, 5.4),
    _ev(0, "recv grad 0B1", 5.4, 5.7),
    _ev(0, "0B1", 5.7, 6.7),  # 1B1 ends 5.6: 0.2 producer wait, 0.1 in the receive
    _ev(0, "0W1", 6.7, 7.2),
    _ev(1, "recv act 1F0", 0.0, 1.5),  # before rank 1's span
    _ev(1, "1F0", 1.5, 2.5),
    _ev(1, "1B0", 2.5, 3.5),
    _ev(1, "1F1", 3.6, 4.6),  # 0F1 ended at 2.2: 0.1 dispatch
    _ev(1, "1B1", 4.6, 5.6),
    _ev(1, "1W0", 5.6, 6.1),
    _ev(1, "1W1", 6.3, 6.8),  # 0.2 dispatch
]
SCHEDULE = build_schedule("zb-h1", n_stages=2, n_microbatches=2)


def test_replay_runs_each_action_at_its_own_duration():
    # By hand: rank 0 0F0 [0,1] 0F1 [1,2]; rank 1 1F0 [1,2] 1B0 [2,3] 1F1 [3,4] 1B1 [4,5] 1W0 [5,5.5]
    # 1W1 [5.5,6]; rank 0 0B0 [3,4] 0W0 [4,4.5] 0B1 [5,6] 0W1 [6,6.5].
    rep = replay_measured(EVENTS, SCHEDULE)
    assert rep.starts[0] == pytest.approx((0.0, 1.0, 3.0, 4.0, 5.0, 6.0))
    assert rep.ends[1] == pytest.approx((2.0, 3.0, 4.0, 5.0, 5.5, 6.0))
    assert rep.rank_spans == pytest.approx((6.5, 5.0))
    assert rep.rank_compute == pytest.approx((5.0, 5.0))
    assert rep.bubble_ratio == pytest.approx(1.5 / 6.5)
    # With a transfer latency every cross-rank input arrives 0.25 later: rank 0's B0 at 3.25 + ... (1F0 at 1.25).
    late = replay_measured(EVENTS, SCHEDULE, comm=0.25)
    assert late.starts[1][0] == pytest.approx(1.25)
    assert late.rank_spans[0] > rep.rank_spans[0]


def test_overhead_split_by_hand_and_adds_up():
    rank0, rank1 = overhead_split(EVENTS, SCHEDULE)
    assert (rank0.span, rank0.replay_span, rank0.compute) == pytest.approx((7.2, 6.5, 5.0))
    assert (rank0.dispatch, rank0.transport, rank0.producer_wait, rank0.sync) == pytest.approx(
        (0.3, 0.4, 1.5, 0)
    )
    assert rank0.propagated == pytest.approx(0.0)  # rank 0 waited exactly as long as in the replay
    assert (rank1.span, rank1.replay_span, rank1.dispatch, rank1.transport) == pytest.approx(
        (5.3, 5.0, 0.3, 0)
    )
    for r in (rank0, rank1):
        assert r.overhead == pytest.approx(r.dispatch + r.transport + r.propagated)
    # Not trivially passing: without the receive-wait events the same idle time is dispatch, not transport.
    no_waits = overhead_split([e for e in EVENTS if e.kind != "comm"], SCHEDULE)[0]
    assert no_waits.transport == 0.0 and no_waits.dispatch == pytest.approx(0.7)
    # 0.4 more dispatch on rank 1 before 1B1 (same durations, so the same replay): rank 0 waits 0.4 longer for
    # it, which its split reports as propagated, not as its own overhead.
    shifted = [
        e._replace(start=e.start + 0.4, end=e.end + 0.4) if e.name in ("1B1", "1W0", "1W1") else e
        for e in EVENTS
    ]
    shifted = [
        e._replace(start=6.0, end=6.1)
        if e.name == "recv grad 0B1"
        else e._replace(start=6.1, end=7.1)
        if e.name == "0B1"
        else e._replace(start=7.1, end=7.6)
        if e.name == "0W1"
        else e
        for e in shifted
    ]
    r0 = overhead_split(shifted, SCHEDULE)[0]
    assert r0.producer_wait == pytest.approx(1.3 + 0.6) and r0.propagated == pytest.approx(0.4)
    assert r0.overhead == pytest.approx(r0.dispatch + r0.transport + r0.propagated)


@pytest.mark.parametrize("name", ["1f1b", "zb-h1", "zbv", "dualpipev", "interleaved-1f1b"])
def test_replaying_a_simulation_reproduces_it(name):
    n_stages = 4 if name in ("zbv", "dualpipev", "interleaved-1f1b") else 2
    sched = add_grad_sync(build_schedule(name, n_stages=n_stages, n_microbatches=6))
    f, b, w = (
        [1.0, 1.3, 0.9, 1.1][:n_stages],
        [1.7, 2.1, 1.9, 2.0][:n_stages],
        [0.6, 0.8, 0.7, 0.5][:n_stages],
    )
    sim = simulate(sched, f=f, b=b, w=w, sync=0.25)
    rep = replay_measured(sim.events(), sched)
    for mine, theirs in ((rep.starts, sim.starts), (rep.ends, sim.ends)):
        assert [len(x) for x in mine] == [len(x) for x in theirs]
        assert [t for x in mine for t in x] == pytest.approx([t for x in theirs for t in x], abs=1e-12)
    for r in overhead_split(sim.events(), sched, rep):
        assert r.overhead == pytest.approx(0.0, abs=1e-12)
        assert r.dispatch == pytest.approx(0.0, abs=1e-12) and r.transport == 0.0


def test_events_that_are_not_the_schedule_are_refused():
    with pytest.raises(ValueError, match=r"rank 1 recorded 5 actions.*'zb-h1' has 6.*position 5"):
        replay_measured([e for e in EVENTS if e.name != "1W1"], SCHEDULE)
    swapped = [e._replace(name="0W1") if e.name == "0W0" else e for e in EVENTS]
    with pytest.raises(ValueError, match="differ at position 3"):
        overhead_split(swapped, SCHEDULE)
    with pytest.raises(ValueError, match="comm must be a non-negative"):
        replay_measured(EVENTS, SCHEDULE, comm=-1.0)
