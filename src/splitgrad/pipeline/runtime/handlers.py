"""What a :class:`~splitgrad.pipeline.PipelineRuntime` does for each action kind: one handler per kind.

A handler is ``handler(runtime, action, received)``: ``received`` maps each
:class:`~splitgrad.pipeline.ir.Transfer` the action needed to the tensor that arrived (the runtime has
already waited for them). Compute kinds run through the runtime's
:class:`~splitgrad.pipeline.runtime.executor.StageExecutor` inside the ``no_sync()`` of data-parallel stages whose
``R`` point has not run yet, then queue what they produced for the next rank (or hand it over locally);
``R``/``RF`` open and finish a stage's gradient reduction. A new action kind touches the IR, the simulator
and one entry of :func:`default_handlers`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from ..ir.actions import Action, ActionKind, AnyAction, Transfer

if TYPE_CHECKING:
    from .pipeline_runtime import PipelineRuntime

__all__ = ["Handler", "default_handlers"]

Received = dict[Transfer, torch.Tensor]
Handler = Callable[["PipelineRuntime", AnyAction, Received], None]


def default_handlers() -> dict[ActionKind, Handler]:
    """A fresh kind -> handler table (plain functions: a table of bound methods on the runtime would be a
    reference cycle keeping a dropped runtime, and its process groups, alive until the garbage collector)."""
    return {
        ActionKind.F: forward,
        ActionKind.B: backward,
        ActionKind.BW: backward,
        ActionKind.W: weight,
        ActionKind.FB: overlapped,
        ActionKind.R: open_grad_sync,
        ActionKind.RF: finish_grad_sync,
    }


def forward(rt: PipelineRuntime, action: Action, received: Received) -> None:
    """``F``: run the stage on the microbatch's input and send / hand over its output."""
    with _syncing(rt, action.stage):
        out = rt.executor.forward(action.stage, action.microbatch, _input(rt, action, received))
    _deliver(rt, action, out)


def backward(rt: PipelineRuntime, action: Action, received: Received) -> None:
    """``B`` (W work parked in a bundle) or ``BW`` (run at once); the input gradient goes to the previous stage."""
    stage, kind, mb = action
    with _syncing(rt, stage):
        out = rt.executor.backward(stage, mb, _input(rt, action, received), run_weight=kind is ActionKind.BW)
    _deliver(rt, action, out)


def weight(rt: PipelineRuntime, action: Action, received: Received) -> None:
    """``W``: run exactly the bundle its ``B`` parked."""
    with _syncing(rt, action.stage):
        rt.executor.weight(action.stage, action.microbatch)


def overlapped(rt: PipelineRuntime, action: AnyAction, received: Received) -> None:
    """An overlapped ``F`` + ``B``/``BW`` pair (the stage's ``overlapped_forward_backward`` when it has one)."""
    f, b = action.parts
    with _syncing(rt, f.stage, b.stage):
        f_out, b_out = rt.executor.overlapped(
            (f.stage, f.microbatch, _input(rt, f, received)),
            (b.stage, b.microbatch, _input(rt, b, received)),
            run_weight=b.kind is ActionKind.BW,
        )
    _deliver(rt, f, f_out)
    _deliver(rt, b, b_out)


def open_grad_sync(rt: PipelineRuntime, action: Action, received: Received) -> None:
    """``R``: the stage's later actions run outside ``no_sync()``, so its buckets reduce as they fill."""
    rt._sync_open.add(action.stage)


def finish_grad_sync(rt: PipelineRuntime, action: Action, received: Received) -> None:
    """``RF``: wait for the stage's gradient reduction (``finish_grad_sync()``)."""
    module = rt.grad_sync.get(action.stage)
    if module is not None:
        rt._sync_open.add(action.stage)
        module.finish_grad_sync()
        # A wrapper that times its reductions (FSDPStage) puts them on the stage's comm lane.
        for label, start, end in getattr(module, "pop_comm_events", list)():
            rt.recorder.comm(label, start, end, stage=action.stage, kind="grad-sync")


def _syncing(rt: PipelineRuntime, *stages: int) -> contextlib.AbstractContextManager[None]:
    """``no_sync()`` of every given data-parallel stage whose ``R`` point has not run yet."""
    held = [rt.grad_sync[s] for s in stages if s in rt.grad_sync and s not in rt._sync_open]
    if not held:
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    for module in held:
        stack.enter_context(module.no_sync())
    return stack


def _deliver(rt: PipelineRuntime, part: Action, out: torch.Tensor | None) -> None:
    """Queue ``part``'s output for its consumer: a send to another rank or a local hand-off."""
    if out is None:
        return
    outgoing = rt.schedule.send_after(part)
    if outgoing is not None:
        rt.comm.queue_send(outgoing, out, part)
    else:
        rt.executor.hand_over(
            "activation" if part.kind is ActionKind.F else "gradient", part.stage, part.microbatch, out
        )


def _input(rt: PipelineRuntime, part: Action, received: Received) -> torch.Tensor | None:
    transfer = rt.schedule.recv_before(part)
    return None if transfer is None else received[transfer]
