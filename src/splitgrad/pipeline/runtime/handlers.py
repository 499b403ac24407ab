"""What a :class:`~splitgrad.pipeline.PipelineRuntime` does for each action kind: one handler per kind.

A handler is ``handler(ctx, action, received)``: ``ctx`` is a :class:`HandlerContext`, exactly what handlers
may touch (the schedule being run, the executor, the transport, the stages' data-parallel wrappers, the
timeline's comm lane), never the runtime itself; ``received`` maps each :class:`~splitgrad.pipeline.ir.actions.Transfer`
the action needed to the tensor that arrived (the runtime has already waited for them). Compute kinds run
through the :class:`~splitgrad.pipeline.runtime.executor.StageExecutor` inside the ``no_sync()`` of
data-parallel stages whose ``R`` point has not run yet, then queue what they produced for the next rank (or
hand it over locally); ``R``/``RF`` open and finish a stage's gradient reduction. A new action kind touches
the IR, the simulator and one entry of :func:`default_handlers`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from ..ir.actions import Action, ActionKind, AnyAction, Schedule, Transfer
from .comm import PipelineComm
from .executor import StageExecutor

__all__ = ["Handler", "HandlerContext", "Received", "default_handlers"]

Received = dict[Transfer, torch.Tensor]
"""What an action received: each :class:`~splitgrad.pipeline.ir.actions.Transfer` it needed -> the tensor that came."""


@dataclass(slots=True)
class HandlerContext:
    """What every handler may use. The runtime builds one for each installed schedule."""

    schedule: Schedule
    """The schedule being run (lowered): which transfer precedes or follows an action."""
    executor: StageExecutor
    """Computes ``F``/``B``/``W``/``BW`` on this rank's stages and keeps local hand-offs."""
    comm: PipelineComm | None
    """Queues sends to other ranks; None on a one-rank pipeline (every hand-off is local)."""
    grad_sync: Mapping[int, nn.Module]
    """Stage -> its data-parallel wrapper (``no_sync()``, ``finish_grad_sync()``), for the stages that have one."""
    record_comm: Callable[..., None]
    """``record_comm(label, start, end, *, stage, kind)``: an interval on the timeline's comm lane."""
    sync_open: set[int] = field(default_factory=set)
    """Stages whose ``R`` point ran this step (their later actions run outside ``no_sync()``)."""


Handler = Callable[[HandlerContext, AnyAction, Received], None]
"""``handler(ctx, action, received)``: run one action of this rank."""


def default_handlers() -> dict[ActionKind, Handler]:
    """A fresh kind -> handler table (plain functions, so the table holds no runtime and no cycle through it)."""
    return {
        ActionKind.F: forward,
        ActionKind.B: backward,
        ActionKind.BW: backward,
        ActionKind.W: weight,
        ActionKind.FB: overlapped,
        ActionKind.R: open_grad_sync,
        ActionKind.RF: finish_grad_sync,
    }


def forward(ctx: HandlerContext, action: Action, received: Received) -> None:
    """``F``: run the stage on the microbatch's input and send / hand over its output."""
    with _syncing(ctx, action.stage):
        out = ctx.executor.forward(action.stage, action.microbatch, _input(ctx, action, received))
    _deliver(ctx, action, out)


def backward(ctx: HandlerContext, action: Action, received: Received) -> None:
    """``B`` (W work parked in a bundle) or ``BW`` (run at once); the input gradient goes to the previous stage."""
    stage, kind, mb = action
    with _syncing(ctx, stage):
        out = ctx.executor.backward(
            stage, mb, _input(ctx, action, received), run_weight=kind is ActionKind.BW
        )
    _deliver(ctx, action, out)


def weight(ctx: HandlerContext, action: Action, received: Received) -> None:
    """``W``: run exactly the bundle its ``B`` parked."""
    with _syncing(ctx, action.stage):
        ctx.executor.weight(action.stage, action.microbatch)


def overlapped(ctx: HandlerContext, action: AnyAction, received: Received) -> None:
    """An overlapped ``F`` + ``B``/``BW`` pair (the stage's ``overlapped_forward_backward`` when it has one)."""
    f, b = action.parts
    with _syncing(ctx, f.stage, b.stage):
        f_out, b_out = ctx.executor.overlapped(
            (f.stage, f.microbatch, _input(ctx, f, received)),
            (b.stage, b.microbatch, _input(ctx, b, received)),
            run_weight=b.kind is ActionKind.BW,
        )
    _deliver(ctx, f, f_out)
    _deliver(ctx, b, b_out)


def open_grad_sync(ctx: HandlerContext, action: Action, received: Received) -> None:
    """``R``: the stage's later actions run outside ``no_sync()``, so its buckets reduce as they fill."""
    ctx.sync_open.add(action.stage)


def finish_grad_sync(ctx: HandlerContext, action: Action, received: Received) -> None:
    """``RF``: wait for the stage's gradient reduction (``finish_grad_sync()``)."""
    module = ctx.grad_sync.get(action.stage)
    if module is not None:
        ctx.sync_open.add(action.stage)
        module.finish_grad_sync()
        # A wrapper that times its reductions (FSDPStage) puts them on the stage's comm lane.
        for label, start, end in getattr(module, "pop_comm_events", list)():
            ctx.record_comm(label, start, end, stage=action.stage, kind="grad-sync")


def _syncing(ctx: HandlerContext, *stages: int) -> contextlib.AbstractContextManager[None]:
    """``no_sync()`` of every given data-parallel stage whose ``R`` point has not run yet."""
    held = [ctx.grad_sync[s] for s in stages if s in ctx.grad_sync and s not in ctx.sync_open]
    if not held:
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    for module in held:
        stack.enter_context(module.no_sync())
    return stack


def _deliver(ctx: HandlerContext, part: Action, out: torch.Tensor | None) -> None:
    """Queue ``part``'s output for its consumer: a send to another rank or a local hand-off."""
    if out is None:
        return
    outgoing = ctx.schedule.send_after(part)
    if outgoing is not None:
        ctx.comm.queue_send(outgoing, out, part)
    else:
        ctx.executor.hand_over(
            "activation" if part.kind is ActionKind.F else "gradient", part.stage, part.microbatch, out
        )


def _input(ctx: HandlerContext, part: Action, received: Received) -> torch.Tensor | None:
    transfer = ctx.schedule.recv_before(part)
    return None if transfer is None else received[transfer]
