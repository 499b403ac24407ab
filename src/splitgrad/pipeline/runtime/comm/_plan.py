"""What a schedule implies for one rank's point-to-point messages, derived once before any step.

Both ends of every message derive the same facts from the same :class:`~splitgrad.pipeline.ir.actions.Schedule`,
which is how :class:`~splitgrad.pipeline.runtime.comm.PipelineComm` agrees with its peers without talking: the order
in which each peer sends to this rank (receives are posted in that order), which messages open a channel (and
so carry a shape header on the first step), the action index at which each message is produced and consumed
(what proves a send delivered), and the tag of every message. Nothing here touches a process group.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...ir.actions import Schedule, Transfer
from ._state import MessageKey, message_key

__all__ = ["MessagePlan", "plan_messages"]


@dataclass(frozen=True, slots=True)
class MessagePlan:
    """One rank's messages of a schedule (keys are :func:`~splitgrad.pipeline.runtime.comm._state.message_key`)."""

    from_peer: dict[int, list[tuple[Transfer, bool]]]
    """Per sending rank, its messages to this rank in its send order, each with "opens its channel"."""
    first_out: frozenset[MessageKey]
    """This rank's sends that open a channel ``(dst_rank, kind, src_stage)``: the ones a header may precede."""
    position: dict[MessageKey, tuple[int, int]]
    """Incoming message -> ``(sender, index in from_peer[sender])``."""
    produced_at: dict[MessageKey, int]
    """Incoming message -> index, in its sender's action list, of the action that sends it."""
    consumed_at: dict[MessageKey, int]
    """Outgoing message -> index, in its receiver's action list, of the action that receives it."""
    tag_base: int
    """Channels per microbatch: two per stage (activation, gradient)."""

    def tag(self, transfer: Transfer, header: bool) -> int:
        """The message's tag, unique within a step: its channel and microbatch, and header or payload."""
        channel = 2 * transfer.src_stage + (transfer.kind == "gradient")
        return 2 * (transfer.microbatch * self.tag_base + channel) + header

    def n_incoming(self) -> int:
        """How many messages this rank receives in a step."""
        return sum(len(msgs) for msgs in self.from_peer.values())


def plan_messages(schedule: Schedule, rank: int) -> MessagePlan:
    """Walk every rank's actions once and collect what ``rank`` sends and receives, in order.

    Args:
        schedule: the schedule every rank runs.
        rank: this rank's index in the schedule.
    """
    from_peer: dict[int, list[tuple[Transfer, bool]]] = {}
    first_out: set[MessageKey] = set()
    position: dict[MessageKey, tuple[int, int]] = {}
    produced_at: dict[MessageKey, int] = {}
    consumed_at: dict[MessageKey, int] = {}
    for src, actions in enumerate(schedule.rank_actions):
        opened: set[tuple[int, str, int]] = set()
        for index, action in enumerate(actions):
            for t in schedule.receives(action):
                if t.src_rank == rank:
                    consumed_at[message_key(t)] = index
            for out in schedule.sends(action):
                channel = (out.dst_rank, out.kind, out.src_stage)
                first = channel not in opened
                opened.add(channel)
                if src == rank and first:
                    first_out.add(message_key(out))
                if out.dst_rank == rank:
                    msgs = from_peer.setdefault(src, [])
                    position[message_key(out)] = (src, len(msgs))
                    produced_at[message_key(out)] = index
                    msgs.append((out, first))
    return MessagePlan(
        from_peer=from_peer,
        first_out=frozenset(first_out),
        position=position,
        produced_at=produced_at,
        consumed_at=consumed_at,
        tag_base=2 * schedule.n_stages,
    )
