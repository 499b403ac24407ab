"""Per-step bookkeeping of :class:`~splitgrad.pipeline.runtime.comm.PipelineComm`: messages in flight, sends held."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ...ir.actions import Action, Transfer
from .stats import CommStats

__all__ = ["Channel", "Incoming", "MessageKey", "Meta", "Sent", "StepState", "describe", "message_key"]

MessageKey = tuple[str, int, int]
"""``(kind, src_stage, microbatch)`` identifies one message within a step."""
Meta = tuple[tuple[int, ...], torch.dtype]
Channel = tuple[str, int]


def message_key(transfer: Transfer) -> MessageKey:
    return (transfer.kind, transfer.src_stage, transfer.microbatch)


def describe(transfer: Transfer) -> str:
    """``"activation of stage 0 -> 1, microbatch 3"``."""
    return f"{transfer.kind} of stage {transfer.src_stage} -> {transfer.dst_stage}, microbatch {transfer.microbatch}"


@dataclass(slots=True)
class Incoming:
    """Receive state of one message: header (if it carries one), then payload."""

    transfer: Transfer
    carries_header: bool
    header: torch.Tensor | None = None
    header_work: dist.Work | None = None
    payload: torch.Tensor | None = None
    payload_work: dist.Work | None = None
    posted_at: float = 0.0
    consumed: bool = False


@dataclass(slots=True)
class Sent:
    """A posted send (payload or header), held until its delivery is waited."""

    work: dist.Work
    tensor: torch.Tensor
    transfer: Transfer
    action: Action


@dataclass(slots=True)
class StepState:
    """Per-step bookkeeping: shapes, messages being received, sends queued or in flight."""

    meta_out: dict[Channel, Meta] = field(default_factory=dict)
    meta_in: dict[Channel, Meta] = field(default_factory=dict)
    incoming: dict[MessageKey, Incoming] = field(default_factory=dict)
    next_index: dict[int, int] = field(default_factory=dict)
    queued: list[dist.P2POp] = field(default_factory=list)
    queued_about: list[tuple[Transfer, Action]] = field(default_factory=list)
    sent: list[Sent] = field(default_factory=list)
    stats: CommStats = field(default_factory=CommStats)
