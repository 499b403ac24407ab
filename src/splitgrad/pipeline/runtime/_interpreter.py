"""One rank's action list interpreted, once per step: receive, dispatch by kind, time, post receives ahead.

Every action reaches its handler through one table (kind -> handler, :mod:`~.handlers`), so a new kind touches
the IR, the simulator and one handler; the handler gets a :class:`~.handlers.HandlerContext`, not the runtime.
Receives are posted ahead: those of the next ``prefetch_depth`` actions are posted before the current one
computes (their buffers allocated from the channel shapes agreed on the first step), so a peer's send moves
while this rank computes.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from contextlib import nullcontext

import torch

from ...core.profiling import profiler_active
from ..ir.actions import ActionKind, AnyAction, Schedule, Transfer
from .handlers import Handler, HandlerContext
from .recording import TimelineRecorder

__all__ = ["Interpreter"]


class Interpreter:
    """Runs ``rank``'s actions of ``schedule`` (lowered), one step per :meth:`run`.

    Args:
        schedule: the installed schedule.
        rank: this rank.
        ctx: what the handlers may use; ``ctx.comm`` moves the messages (None on a one-rank pipeline).
        handlers: the kind -> handler table (looked up per action: replacing an entry instruments that kind).
        recorder: times every action.
        prefetch_depth: how many actions ahead receives are posted.
    """

    __slots__ = (
        "_names", "_rank", "_receives", "action_cpu", "actions", "ctx", "current", "handlers", "prefetch_depth",
        "recorder",
    )  # fmt: skip

    def __init__(
        self,
        schedule: Schedule,
        rank: int,
        ctx: HandlerContext,
        handlers: Mapping[ActionKind, Handler],
        recorder: TimelineRecorder,
        prefetch_depth: int,
    ) -> None:
        self.actions = schedule.rank_actions[rank]
        self._rank = rank
        # What each action receives and its profiler range name, looked up once here instead of in every step.
        self._receives = [schedule.receives(a) for a in self.actions]
        self._names = [a.name for a in self.actions]
        self.ctx, self.handlers, self.recorder, self.prefetch_depth = ctx, handlers, recorder, prefetch_depth
        self.current: AnyAction | None = None
        """The action running (still set when a step fails in it)."""
        self.action_cpu = 0.0
        """CPU seconds the last step spent inside the handlers."""

    def run(self) -> None:
        """Run every action once (the transport's step is begun and finished by the caller).

        Raises:
            BaseException: whatever an action raised, with a note naming this rank, the action and the schedule.
        """
        self.ctx.sync_open.clear()
        self.action_cpu = 0.0
        if self.ctx.comm is not None:
            for ahead in range(min(self.prefetch_depth, len(self.actions))):
                self._prefetch(ahead)
        try:
            for j, action in enumerate(self.actions):
                self.current = action
                self._run(j, action)
        except BaseException as exc:
            if hasattr(exc, "add_note"):  # Python >= 3.11
                exc.add_note(
                    f"while pipeline rank {self._rank} ran action {self.current} of schedule "
                    f"{self.ctx.schedule.name!r}"
                )
            raise
        self.current = None

    def _run(self, j: int, action: AnyAction) -> None:
        received: dict[Transfer, torch.Tensor] = {}
        comm = self.ctx.comm
        if comm is not None:
            incoming = self._receives[j]
            for transfer in incoming:
                received[transfer] = comm.receive(transfer, action)
            if not incoming:
                comm.flush(action)
            # Post the receives that now enter the window only now, so that at most prefetch_depth actions'
            # buffers are held (posting them before the wait above would hold one more during it).
            if j + self.prefetch_depth < len(self.actions):
                self._prefetch(j + self.prefetch_depth)
        # The recorder's action() block, inlined (this runs once per action); the named profiler range only
        # while a profiler records.
        with torch.profiler.record_function(self._names[j]) if profiler_active() else nullcontext():
            start, cpu = time.perf_counter(), time.thread_time()
            self.handlers[action.kind](self.ctx, action, received)
            self.action_cpu += time.thread_time() - cpu
            end = time.perf_counter()
        self.recorder.record(action, start, end)

    def _prefetch(self, j: int) -> None:
        """Post (without blocking) the receives of this rank's ``j``-th action."""
        for transfer in self._receives[j]:
            self.ctx.comm.prefetch(transfer, self.actions[j])
