"""The message plan ``PipelineComm`` derives from a schedule: both ends of every message must agree on it.

Why: ranks never negotiate; each derives from the schedule alone who sends it what, in which order, at which
action, under which tag (``splitgrad.pipeline.runtime.comm._plan``). Two messages of a step with the same tag, or a
sender and a receiver disagreeing about where a message is produced or consumed, would pair a payload with the
wrong buffer or release a send before it was received. Process-free: the plan reads only the schedule.
"""

from __future__ import annotations

import dataclasses

import pytest

from splitgrad.pipeline import build_schedule
from splitgrad.pipeline.ir.actions import Schedule
from splitgrad.pipeline.runtime.comm._plan import MessagePlan, plan_messages
from splitgrad.pipeline.runtime.comm._state import message_key

#: (name, n_stages, n_microbatches): one and two stages per rank, overlapped F+B actions (dualpipev).
SCHEDULES = [("1f1b", 2, 4), ("zb-h1", 3, 6), ("zbv", 4, 4), ("interleaved-1f1b", 4, 4), ("dualpipev", 4, 6)]


def _tag_collisions(plan: MessagePlan) -> list[tuple[int, int]]:
    """Tags this rank's receives share, per peer (headers and payloads alike)."""
    seen: dict[tuple[int, int], object] = {}
    clashes = []
    for peer, msgs in plan.from_peer.items():
        for transfer, _ in msgs:
            for header in (False, True):
                key = (peer, plan.tag(transfer, header))
                if key in seen:
                    clashes.append(key)
                seen[key] = transfer
    return clashes


def _disagreements(schedule: Schedule, plans: list[MessagePlan]) -> list[str]:
    """Where a receiver's plan and its sender's disagree, or either disagrees with the schedule."""
    problems = []
    for dst, plan in enumerate(plans):
        for src, msgs in plan.from_peer.items():
            sender_actions, receiver_actions = schedule.rank_actions[src], schedule.rank_actions[dst]
            produced = [plan.produced_at[message_key(t)] for t, _ in msgs]
            if produced != sorted(produced):
                problems.append(f"{src} -> {dst}: not in the sender's order: {produced}")
            for index, (transfer, opens) in enumerate(msgs):
                key = message_key(transfer)
                if plan.position[key] != (src, index):
                    problems.append(f"{key}: position {plan.position[key]}, listed at {(src, index)}")
                if transfer not in schedule.sends(sender_actions[plan.produced_at[key]]):
                    problems.append(f"{key}: not sent by {sender_actions[plan.produced_at[key]]}")
                if transfer not in schedule.receives(receiver_actions[plans[src].consumed_at[key]]):
                    problems.append(f"{key}: not received by {receiver_actions[plans[src].consumed_at[key]]}")
                if opens != (key in plans[src].first_out):
                    problems.append(f"{key}: the ends disagree whether it opens its channel")
    return problems


@pytest.mark.parametrize(("name", "n_stages", "n_microbatches"), SCHEDULES)
def test_both_ends_agree_and_tags_are_unique(name, n_stages, n_microbatches):
    schedule = build_schedule(name, n_stages, n_microbatches)
    plans = [plan_messages(schedule, rank) for rank in range(schedule.n_ranks)]
    assert _disagreements(schedule, plans) == []
    assert [_tag_collisions(plan) for plan in plans] == [[]] * schedule.n_ranks
    # Every cross-rank message of the schedule is planned exactly once, by its receiver; one header per channel.
    sent = [t for actions in schedule.rank_actions for a in actions for t in schedule.sends(a)]
    assert sum(plan.n_incoming() for plan in plans) == len(sent) > 0
    planned = {message_key(t) for plan in plans for msgs in plan.from_peer.values() for t, _ in msgs}
    assert planned == {message_key(t) for t in sent}
    channels = {(t.dst_rank, t.kind, t.src_stage) for t in sent}
    assert sum(len(plan.first_out) for plan in plans) == len(channels)


def test_the_checks_see_a_wrong_plan():
    # Negative checks: tags that ignore the microbatch (tag_base 0) make two messages share a tag, and a plan
    # that lists a peer's first two messages swapped disagrees with the sender.
    schedule = build_schedule("zbv", 4, 4)
    plans = [plan_messages(schedule, rank) for rank in range(schedule.n_ranks)]
    assert _tag_collisions(dataclasses.replace(plans[1], tag_base=0))
    msgs = plans[1].from_peer[0]
    swapped = {**plans[1].from_peer, 0: [msgs[1], msgs[0], *msgs[2:]]}
    assert _disagreements(schedule, [plans[0], dataclasses.replace(plans[1], from_peer=swapped)])
