"""Load-independent evidence of how one rank's pipeline messages moved during a step.

Wall-clock waits on a loaded machine mix transport with a late producer; these records do not: when each
receive was posted relative to when its action needed it, how many receives were posted ahead, how many
shape headers were exchanged, how many bytes of receive buffers and of sent-but-unconfirmed tensors were
held at once. :class:`~splitgrad.pipeline.runtime.comm.PipelineComm` fills one :class:`CommStats` per step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["CommStats", "ReceiveRecord"]


@dataclass(frozen=True, slots=True)
class ReceiveRecord:
    """One received message: ``time.perf_counter`` values (comparable across processes on one host)."""

    label: str
    """``"<kind> <action>"``, e.g. ``"activation 1F3"``."""
    posted: float
    """When the payload's receive was posted."""
    needed: float
    """When the action that uses it asked for it."""
    done: float
    """When the blocking wait returned (the data is in hand)."""
    tag: int
    """The message's tag (matches the sender's :attr:`CommStats.send_posted` key)."""


@dataclass(slots=True)
class CommStats:
    """One step of one rank's point-to-point traffic."""

    receives: list[ReceiveRecord] = field(default_factory=list)
    """Every payload received, in the order the actions used them."""
    send_posted: dict[int, float] = field(default_factory=dict)
    """Payload tag -> when this rank posted that send."""
    posted_ahead: int = 0
    """Receives whose payload was already posted when the action needed it."""
    headers: int = 0
    """Shape headers received (0 after the first step unless shapes were reset)."""
    released_early: int = 0
    """Sends released before the end of the step because the peer provably consumed them."""
    peak_recv_bytes: int = 0
    """Most bytes of posted receive buffers not yet handed to an action, at any time."""
    peak_send_bytes: int = 0
    """Most bytes of sent tensors held until their delivery was confirmed, at any time."""
    recv_bytes: int = 0
    send_bytes: int = 0

    def add_recv(self, nbytes: int) -> None:
        self.recv_bytes += nbytes
        self.peak_recv_bytes = max(self.peak_recv_bytes, self.recv_bytes)

    def add_send(self, nbytes: int) -> None:
        self.send_bytes += nbytes
        self.peak_send_bytes = max(self.peak_send_bytes, self.send_bytes)
