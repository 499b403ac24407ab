"""Run a :class:`~splitgrad.pipeline.Schedule` on torch.distributed: each rank interprets its action list.

The runtime decides nothing: what it does is in the schedule, lowered before it runs (:mod:`~.setup`), and each
action goes to its kind's handler (``_interpreter.py``, :mod:`~.handlers`). This class holds the parts of one
rank (stages, executor, transport, recorder) and runs steps.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ...distributed.group_ref import GroupRef
from ..ir.actions import ActionKind, Schedule
from ..ir.validate import validate
from ..timeline.events import TimelineEvent
from ..timeline.report import timeline_report
from ._interpreter import Interpreter
from ._lifecycle import Lifecycle
from ._stages import LocalStages
from .comm import PipelineComm
from .executor import LossFn, StageExecutor
from .handlers import Handler, HandlerContext, default_handlers
from .recording import ActivationMeter, TimelineRecorder, gather_events
from .result import StepResult, mean_loss
from .setup import check_options, check_same_layout, lower_schedule, resolve_pipeline_rank

__all__ = ["PipelineRuntime"]


class PipelineRuntime:
    """Interpret one rank's share of ``schedule``: its stages, point-to-point messages, W bundles, DP sync.

    Example (every rank of a 2-rank pipeline group; ``stages`` is the whole model cut into 2)::

        sched = build_schedule("zb-h1", n_stages=2, n_microbatches=4)
        rt = PipelineRuntime(stages, sched, loss_fn=F.cross_entropy)
        result = rt.step(inputs, targets)       # inputs/targets: a batch tensor or 4 microbatches
        optimizer.step()

    Args:
        stages: the model stages this rank runs: ``{stage index: module}``, *all* stages of the model in order
            (this rank keeps its own), or exactly this rank's stages in ascending order. Each maps one tensor to
            one (any shape, e.g. ``(batch, seq, hidden)``; floating point between stages). Build splitgrad
            layers with ``delay_wgrad_compute=True`` for ``W`` to do any work.
        schedule: the schedule every rank runs (validated here). Without gradient-sync points it is lowered
            with :func:`~splitgrad.pipeline.passes.add_grad_sync` when a local stage can sync gradients
            (``no_sync()`` and ``finish_grad_sync()``, e.g. :class:`splitgrad.parallel.DistributedDataParallel`);
            :attr:`schedule` is what runs.
        loss_fn: ``loss_fn(last stage output, target) -> scalar`` for one microbatch; the step's loss is the
            mean over microbatches (gradients are scaled by ``1 / n_microbatches``).
        rank: this rank's index in the schedule; default: its rank in ``pp_group``.
        pp_group: the pipeline process group (None: the default group). Not needed on a one-rank schedule.
        timeout: seconds any single wait for a peer may take before a ``RuntimeError`` naming the peer and
            the action.
        record_timeline: record the start/end of every action and receive wait (adds one barrier per step
            to share the time origin).
        track_memory: measure activation bytes (see :attr:`StepResult.peak_activation_bytes`).
        broadcast_loss: broadcast the step's loss from the last stage's rank to every pipeline rank.
        device: where received tensors are allocated; default: the device of the local stages' parameters.
        prefetch: post receives before the actions that need them run; default: on for gloo (NCCL pairs a
            receive posted ahead with the wrong send on a shared stream).
        prefetch_depth: with ``prefetch``, how many actions ahead receives are posted (each holds its
            receive buffer from then on: the memory cost, see :attr:`StepResult.comm`).
        check_schedule: run :func:`splitgrad.pipeline.validate` on ``schedule`` first.
    """

    def __init__(
        self,
        stages: Mapping[int, nn.Module] | Sequence[nn.Module],
        schedule: Schedule,
        *,
        loss_fn: LossFn,
        rank: int | None = None,
        pp_group: dist.ProcessGroup | None = None,
        timeout: float = 300.0,
        record_timeline: bool = True,
        track_memory: bool = False,
        broadcast_loss: bool = True,
        device: torch.device | str | None = None,
        prefetch: bool | None = None,
        prefetch_depth: int = 2,
        check_schedule: bool = True,
    ) -> None:
        check_options(timeout=timeout, prefetch_depth=prefetch_depth)
        if check_schedule:
            validate(schedule)
        self.rank = resolve_pipeline_rank(schedule, rank=rank, pp_group=pp_group, who="PipelineRuntime")
        # Looked up at use, never held (distributed/group_ref.py): a runtime left in the user's globals must not
        # keep the group's gloo workers alive past destroy_process_group().
        self._pp_group = GroupRef(pp_group, owner="PipelineRuntime.pp_group")
        self.loss_fn, self.timeout, self.broadcast_loss = loss_fn, float(timeout), broadcast_loss
        self._local = LocalStages(schedule, self.rank, stages, device)
        local = self._local
        self.stages, self.grad_sync, self.device = local.modules, local.grad_sync, local.device
        self.last_stage = schedule.n_stages - 1
        self._distributed = dist.is_available() and dist.is_initialized() and schedule.n_ranks > 1
        if prefetch is None and self._distributed:
            prefetch = dist.get_backend(pp_group) == "gloo"
        self._prefetch, self.prefetch_depth = bool(prefetch), prefetch_depth
        self.recorder = TimelineRecorder(self.rank, enabled=record_timeline)
        self.executor = StageExecutor(
            self.stages, n_stages=schedule.n_stages, n_microbatches=schedule.n_microbatches, loss_fn=loss_fn,
            meter=ActivationMeter() if track_memory else None,
        )  # fmt: skip
        #: The kind -> handler table every action goes through (replace an entry to instrument one kind).
        self.handlers: dict[ActionKind, Handler] = default_handlers()
        #: Set by build_runtime for ``"zb-auto"``/``"auto"`` (:class:`~.autoplan.ProfileGuidedPlanner`).
        self.planner: Any = None
        self.comm: PipelineComm | None = None
        self._lifecycle = Lifecycle(f"PipelineRuntime (pipeline rank {self.rank})")
        self.install_schedule(schedule, check=False)

    def install_schedule(self, schedule: Schedule, *, check: bool = True) -> None:
        """Run ``schedule`` from the next step on (same stages and microbatch count; every rank must install
        the same one before its next step), lowered for this rank (:func:`~.setup.lower_schedule`).

        Raises:
            ValueError: another stage layout or microbatch count, or a syncing stage without an ``RF`` point.
        """
        if check:
            validate(schedule)
            check_same_layout(self.schedule, schedule)
        self.schedule = schedule = lower_schedule(schedule, self.rank, self.grad_sync)
        if self._distributed:
            self.comm = PipelineComm(
                schedule, self.rank, group=self.pp_group, device=self.device, timeout=self.timeout,
                prefetch=self._prefetch, on_wait=self.recorder.comm, replaces=self.comm,
            )  # fmt: skip
        self._ctx = HandlerContext(schedule, self.executor, self.comm, self.grad_sync, self.recorder.comm)
        self._interpreter = Interpreter(
            schedule, self.rank, self._ctx, self.handlers, self.recorder, self.prefetch_depth
        )
        self.actions = self._interpreter.actions

    def step(self, inputs: Any = None, targets: Any = None) -> StepResult:
        """Run every action of this rank for one batch; gradients accumulate into the stages' parameters.

        Args:
            inputs: on the rank holding stage 0, the first stage's input: one tensor split along dim 0 into
                ``n_microbatches`` equal parts, or a sequence of ``n_microbatches`` per-microbatch inputs.
                Ignored on other ranks.
            targets: on the rank holding the last stage, the loss targets, in the same two forms. Ignored
                elsewhere.

        Raises:
            RuntimeError: a peer crashed or did not answer within ``timeout`` (naming it and the action), or
                weight-gradient work is pending in the stages before the step.
            ValueError: bad inputs/targets, or stage outputs that change shape between microbatches.
        """
        self._lifecycle.check_can_step()
        self.executor.begin_step(inputs, targets)
        self._local.check_no_pending_wgrad("the start of PipelineRuntime.step")
        if self.comm is not None:
            self.comm.begin_step(barrier=self.recorder.enabled)
        cpu_start = time.thread_time()
        self.recorder.start()
        try:
            self._interpreter.run()
            self.executor.check_complete(
                f"PipelineRuntime (pipeline rank {self.rank}, {self.schedule.name!r})"
            )
            if self.comm is not None:
                self.comm.finish_step()
            duration, step_cpu = time.perf_counter() - self.recorder.t0, time.thread_time() - cpu_start
            losses = self.executor.step_losses()
            loss = mean_loss(losses, self.device, self.comm if self.broadcast_loss else None, self.last_stage)
        except BaseException as exc:
            self.executor.abort()
            if self.comm is not None:
                self.comm.abort()
                self._lifecycle.fail(exc, where=str(self._interpreter.current))
            raise
        result = StepResult(
            loss=loss, microbatch_losses=losses, events=list(self.recorder.events), duration=duration,
            peak_activation_bytes=self.executor.peak_activation_bytes, w_tasks=self.executor.w_tasks,
            comm=None if self.comm is None else self.comm.last_stats,
            runtime_cpu=step_cpu - self._interpreter.action_cpu, action_cpu=self._interpreter.action_cpu,
        )  # fmt: skip
        self.executor.begin(None, None)
        if self.planner is not None:
            self.planner.observe(self, result)
        return result

    def reset_shapes(self) -> None:
        """Let the next step's boundary tensors have new shapes (every pipeline rank must call it): the first
        step agrees each channel's shape and dtype in a header, later steps reuse it (receives are posted ahead)
        and raise a ``ValueError`` naming the action for a stage output of another shape unless this was called.
        """
        if self.comm is not None:
            self.comm.reset_shapes()

    @property
    def pp_group(self) -> dist.ProcessGroup | None:
        """The pipeline process group (None: the default group); raises once it was destroyed."""
        return self._pp_group.get_or_none()

    def close(self) -> None:
        """Release this rank's hold on the process groups: the transport, and the stages' data-parallel wrappers.

        Every stage module with a ``close()`` (a :class:`splitgrad.parallel.DistributedDataParallel`, e.g. the
        ones :func:`~splitgrad.pipeline.build_runtime` creates) is closed. Call it (or use the runtime as a
        context manager) before ``dist.destroy_process_group()``; a runtime that is simply dropped releases
        the same, when it is garbage-collected. Idempotent; afterwards :meth:`step` raises.
        """
        if not self._lifecycle.close():
            return
        if self.comm is not None:
            self.comm.abort()
        self.comm = self._ctx.comm = None
        self._pp_group = GroupRef(None, owner="PipelineRuntime.pp_group")
        self._local.close()

    def __enter__(self) -> PipelineRuntime:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def parameters(self) -> list[nn.Parameter]:
        """The parameters of this rank's stages (each once), e.g. for its optimizer."""
        return self._local.parameters()

    def zero_grad(self) -> None:
        """Reset this rank's gradients: ``zero_grad_buffer()`` of data-parallel stages, else ``.grad = None``."""
        self._local.zero_grad()

    def gather_timeline(self, result: StepResult, *, dst: int = 0) -> list[TimelineEvent] | None:
        """Merge every pipeline rank's events of ``result`` on rank ``dst`` (all ranks must call it)."""
        if not self._distributed:
            return list(result.events)
        return gather_events(result.events, group=self.pp_group, dst=dst)

    def timeline_report(
        self, result: StepResult, prefix: str | Path | None = None, *, dst: int = 0
    ) -> str | None:
        """Gather ``result``'s events; on rank ``dst`` return the measured-vs-simulated bubble line and, with
        ``prefix``, write ``<prefix>.json`` (Perfetto) and ``<prefix>.png`` (Gantt)
        (:func:`splitgrad.pipeline.timeline.timeline_report`). All ranks must call it.
        """
        events = self.gather_timeline(result, dst=dst)
        if events is None:
            return None
        plan = getattr(self.planner, "plan", None)
        predicted = plan.predicted_bubble if plan is not None and plan.schedule is self.schedule else None
        return timeline_report(events, self.schedule, prefix, predicted_bubble=predicted)
