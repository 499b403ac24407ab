"""What one :meth:`~splitgrad.pipeline.PipelineRuntime.step` returns on one rank, and its loss."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..timeline.events import TimelineEvent
from .comm import PipelineComm
from .comm.stats import CommStats

__all__ = ["StepResult"]


@dataclass(kw_only=True, slots=True)
class StepResult:
    """What one :meth:`PipelineRuntime.step` returns on one rank."""

    loss: torch.Tensor | None
    """Mean of the microbatch losses, a float64 0-dim tensor on the runtime's device; on every pipeline rank
    with ``broadcast_loss`` (the default), else only on the last stage's rank (None elsewhere)."""
    microbatch_losses: list[torch.Tensor] = field(default_factory=list)
    """Per-microbatch losses (detached) on the last stage's rank; empty elsewhere."""
    events: list[TimelineEvent] = field(default_factory=list)
    """This rank's measured events (seconds since the step's common origin); empty when not recording."""
    peak_activation_bytes: int | None = None
    """With ``track_memory``: peak activation bytes this rank held: what autograd saved in each forward until
    its ``B``, then exactly the wgrad operands parked for its ``W`` (see :class:`~.recording.ActivationMeter`)."""
    duration: float = 0.0
    """Seconds from the step origin until this rank's sends were delivered and its data-parallel reductions
    finished (the loss broadcast not included)."""
    w_tasks: int = 0
    """Deferred weight-gradient tasks this rank's ``W`` actions ran (0 when nothing was split)."""
    comm: CommStats | None = None
    """How this rank's messages moved (when each receive was posted vs needed, headers, held buffer bytes);
    None on a one-rank pipeline."""
    runtime_cpu: float = 0.0
    """CPU seconds (this thread's ``time.thread_time``) the step spent outside its actions' handlers: posting
    and completing messages, the interpreter loop, timeline bookkeeping. Blocking waits use no CPU, so this is
    the runtime's own per-step cost whatever the machine's load (divide by the rank's action count for the
    cost per action)."""
    action_cpu: float = 0.0
    """CPU seconds inside the actions' handlers (compute, and queueing what they produced)."""


def mean_loss(
    losses: list[torch.Tensor], device: torch.device, comm: PipelineComm | None, last_stage: int
) -> torch.Tensor | None:
    """The step's loss: the mean of the microbatch losses (0-dim each), float64 on ``device``.

    Args:
        losses: this rank's microbatch losses (empty unless it holds the last stage).
        device: where the result lives.
        comm: broadcast the mean from the last stage's rank over this transport's group (None: do not, and
            return None on the other ranks).
        last_stage: the model's last stage (its rank holds the losses).
    """
    mean = torch.stack(losses).to(torch.float64).mean().to(device) if losses else None
    if comm is None:
        return mean
    buf = mean if mean is not None else torch.zeros((), dtype=torch.float64, device=device)
    src = comm.schedule.rank_of(last_stage)
    comm.broadcast(buf, src, f"the step loss broadcast from rank {src}")
    return buf
