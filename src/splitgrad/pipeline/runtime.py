"""Run a :class:`~splitgrad.pipeline.Schedule` on torch.distributed: each rank interprets its action list.

The runtime only interprets; schedules are data built elsewhere. For each action of this rank it receives
what the action needs (:class:`~splitgrad.pipeline.comm.PipelineComm`), computes it
(:class:`~splitgrad.pipeline.executor.StageExecutor`: ``F``, ``B`` with the weight-gradient work parked in a
capture bundle, ``W`` running exactly that bundle, ``BW``), times it
(:class:`~splitgrad.pipeline.measure.TimelineRecorder`) and queues what it produces for the next rank.

Every action reaches its handler through one table (kind -> handler, :mod:`~splitgrad.pipeline.handlers`), so a
new kind touches the IR, the simulator and one handler. Receives are posted ahead: the receives of the next
``prefetch_depth`` actions are posted before the current one computes (their buffers allocated from the
channel shapes agreed on the first step), so a peer's send moves while this rank computes. Data parallelism composes per stage, driven by the schedule's gradient-sync points
(:func:`splitgrad.pipeline.passes.add_grad_sync`, applied here when the schedule has none and a stage can sync): a
stage module with ``no_sync()`` and ``finish_grad_sync()`` (a :class:`splitgrad.parallel.DistributedDataParallel`)
runs its actions inside ``no_sync()`` until its ``R`` point, so each bucket starts reducing as soon as its last
contribution (often a ``W``) has run, and ``finish_grad_sync()`` runs at its ``RF`` point.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..core import ensure_no_pending_wgrad
from ..core.profiling import profiler_active
from ..distributed.group_ref import GroupRef
from .actions import Action, ActionKind, AnyAction, Schedule, Transfer
from .comm import PipelineComm
from .executor import LossFn, StageExecutor, split_microbatches
from .handlers import Handler, default_handlers
from .measure import (
    ActivationMeter,
    TimelineRecorder,
    bubble_report,
    gather_events,
    save_measured_timeline,
)
from .passes import add_grad_sync, has_grad_sync
from .runtime_setup import StepResult, own_stages, resolve_pipeline_rank
from .timeline import TimelineEvent
from .validate import validate

__all__ = ["PipelineRuntime", "StepResult", "resolve_pipeline_rank"]

logger = logging.getLogger(__name__)


class PipelineRuntime:
    """Interpret one rank's share of ``schedule``: its stages, point-to-point messages, W bundles, DP sync.

    Example (every rank of a 2-rank pipeline group; ``stages`` is the whole model cut into 2)::

        sched = build_schedule("zb-h1", n_stages=2, n_microbatches=4)
        rt = PipelineRuntime(stages, sched, loss_fn=F.cross_entropy)
        result = rt.step(inputs, targets)       # inputs/targets: a batch tensor or 4 microbatches
        optimizer.step()

    Args:
        stages: the model stages this rank runs: a mapping ``{stage index: module}``, the list of *all* stages
            of the model in order (this rank keeps its own), or the list of exactly this rank's stages in
            ascending order. Each module maps one tensor to one tensor (any shape, e.g. ``(batch, seq,
            hidden)``); boundary tensors must be floating point. Build splitgrad layers with
            ``delay_wgrad_compute=True`` for ``W`` to do any work.
        schedule: the schedule every rank runs (validated here). Without gradient-sync points it is lowered
            with :func:`~splitgrad.pipeline.passes.add_grad_sync` when a local stage can sync gradients;
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
        if not timeout > 0:
            raise ValueError(f"PipelineRuntime: timeout must be positive seconds, got {timeout=}")
        if isinstance(prefetch_depth, bool) or not isinstance(prefetch_depth, int) or prefetch_depth < 1:
            raise ValueError(f"PipelineRuntime: prefetch_depth must be an int >= 1, got {prefetch_depth=}")
        if check_schedule:
            validate(schedule)
        distributed = dist.is_available() and dist.is_initialized()
        rank = resolve_pipeline_rank(schedule, rank=rank, pp_group=pp_group, who="PipelineRuntime")
        self.rank = rank
        # Looked up at use, never held (parallel/group_ref.py): a runtime left in the user's globals must not
        # keep the group's gloo workers alive past destroy_process_group().
        self._pp_group = GroupRef(pp_group, owner="PipelineRuntime.pp_group")
        self.loss_fn = loss_fn
        self.timeout = float(timeout)
        self.broadcast_loss = broadcast_loss
        self.schedule = schedule
        self.stages = own_stages(schedule, rank, stages)
        # Data-parallel wrappers: every stage module that can hold back and finish its gradient reduction.
        self.grad_sync = {
            s: m
            for s, m in self.stages.items()
            if callable(getattr(m, "no_sync", None)) and callable(getattr(m, "finish_grad_sync", None))
        }
        self.first_stage, self.last_stage = 0, schedule.n_stages - 1
        if device is None:
            params = [p for m in self.stages.values() for p in m.parameters()]
            device = params[0].device if params else torch.device("cpu")
        self.device = torch.device(device)
        self._distributed = distributed and schedule.n_ranks > 1
        if self._distributed and prefetch is None:
            prefetch = dist.get_backend(pp_group) == "gloo"
        self.recorder = TimelineRecorder(rank, enabled=record_timeline)
        # Set when a distributed step fails: receives it posted may still be pending in the backend and would
        # take the next step's messages, so the runtime refuses to run again.
        self._failed: str | None = None
        self._closed = False
        self.executor = StageExecutor(
            self.stages,
            n_stages=schedule.n_stages,
            n_microbatches=schedule.n_microbatches,
            loss_fn=loss_fn,
            meter=ActivationMeter() if track_memory else None,
        )
        self._prefetch = bool(prefetch)
        self.prefetch_depth = prefetch_depth
        self.comm: PipelineComm | None = None
        #: Set by :func:`~splitgrad.pipeline.build_runtime` for ``schedule="zb-auto"``/``"auto"``: profiles the
        #: first steps, then installs a plan (:class:`~splitgrad.pipeline.autoplan.ProfileGuidedPlanner`).
        self.planner: Any = None
        self.install_schedule(schedule, check=False)
        # One handler per action kind: the runtime interprets the schedule and decides nothing itself.
        self._handlers: dict[ActionKind, Handler] = default_handlers()
        self._sync_open: set[int] = set()
        self._action_cpu = 0.0

    def install_schedule(self, schedule: Schedule, *, check: bool = True) -> None:
        """Run ``schedule`` from the next step on (same stages and microbatch count; every rank must install
        the same one before its next step). Lowers it with :func:`~splitgrad.pipeline.passes.add_grad_sync` when a
        local stage syncs gradients and the schedule has no sync points.

        Raises:
            ValueError: another stage layout or microbatch count, or a syncing stage without an ``RF`` point.
        """
        old = self.schedule
        if check:
            validate(schedule)
            if (schedule.stage_to_rank, schedule.n_microbatches) != (old.stage_to_rank, old.n_microbatches):
                raise ValueError(
                    f"PipelineRuntime.install_schedule: {schedule.name!r} maps stages {schedule.stage_to_rank} "
                    f"with {schedule.n_microbatches} microbatches; the runtime was built for "
                    f"{old.stage_to_rank} with {old.n_microbatches}"
                )
        if self.grad_sync and not has_grad_sync(schedule):
            schedule = add_grad_sync(schedule)
        unsynced = [
            s
            for s in self.grad_sync
            if Action(s, ActionKind.RF, None) not in schedule.rank_actions[self.rank]
        ]
        if unsynced:
            raise ValueError(
                f"PipelineRuntime: stages {unsynced} sync gradients (no_sync/finish_grad_sync) but schedule "
                f"{schedule.name!r} has no RF point for them; lower it with splitgrad.pipeline.passes.add_grad_sync"
            )
        self.schedule = schedule
        self.actions = schedule.rank_actions[self.rank]
        # What each action receives and its profiler range name, looked up once here instead of in every step.
        self._receives = [schedule.receives(a) for a in self.actions]
        self._names = [a.name for a in self.actions]
        if self._distributed:
            previous, self.comm = (
                self.comm,
                PipelineComm(
                    schedule,
                    self.rank,
                    group=self.pp_group,
                    device=self.device,
                    timeout=self.timeout,
                    prefetch=self._prefetch,
                    on_wait=self.recorder.comm,
                ),
            )
            # Same stage layout: both ends of every channel keep the shapes agreed so far.
            if previous is not None and previous.schedule.stage_to_rank == schedule.stage_to_rank:
                self.comm.keep_shapes_of(previous)

    # -- the step ----------------------------------------------------------------------------------------

    def step(self, inputs: Any = None, targets: Any = None) -> StepResult:
        """Run every action of this rank for one batch; gradients accumulate into the stages' parameters.

        Args:
            inputs: on the rank holding stage 0, the first stage's input: one tensor split along dim 0 into
                ``n_microbatches`` equal parts, or a sequence of ``n_microbatches`` per-microbatch inputs.
                Ignored on other ranks.
            targets: on the rank holding the last stage, the loss targets, in the same two forms. Ignored
                elsewhere.

        Returns:
            A :class:`StepResult`.

        Raises:
            RuntimeError: a peer crashed or did not answer within ``timeout`` (naming it and the action), or
                weight-gradient work is pending in the stages before the step.
            ValueError: bad inputs/targets, or stage outputs that change shape between microbatches.
        """
        if self._closed:
            raise RuntimeError(f"PipelineRuntime (pipeline rank {self.rank}): step() after close()")
        if self._failed is not None:
            raise RuntimeError(
                f"PipelineRuntime (pipeline rank {self.rank}): a previous step failed ({self._failed}); messages "
                "it posted may still be in flight, so this runtime cannot run again. Tear down the process "
                "groups and build a new one"
            )
        m = self.schedule.n_microbatches
        holds_last = self.last_stage in self.stages
        self.executor.begin(
            split_microbatches(inputs, m, "inputs") if self.first_stage in self.stages else None,
            split_microbatches(targets, m, "targets") if holds_last else None,
        )
        for s, module in self.stages.items():
            ensure_no_pending_wgrad(module, what=f"the start of PipelineRuntime.step (stage {s})")
        if self.comm is not None:
            self.comm.begin_step()
            if self.recorder.enabled:
                self._barrier()
        self._sync_open = set()
        self._action_cpu = 0.0
        cpu_start = time.thread_time()
        self.recorder.start()
        current: Action | None = None
        try:
            if self.comm is not None:
                for ahead in range(min(self.prefetch_depth, len(self.actions))):
                    self._prefetch_for(ahead)
            for j, action in enumerate(self.actions):
                current = action
                self._run(j, action)
            current = None
            self.executor.check_complete(
                f"PipelineRuntime (pipeline rank {self.rank}, {self.schedule.name!r})"
            )
            if self.comm is not None:
                self.comm.finish_step()
            duration = time.perf_counter() - self.recorder.t0
            step_cpu = time.thread_time() - cpu_start
            losses = [self.executor.losses[i] for i in range(m)] if holds_last else []
            loss = self._step_loss(losses)
        except BaseException as exc:
            self.executor.abort()
            if self.comm is not None:
                self.comm.abort()
                self._failed = f"{type(exc).__name__} at action {current}"
            if current is not None and hasattr(exc, "add_note"):
                exc.add_note(
                    f"while pipeline rank {self.rank} ran action {current} of schedule {self.schedule.name!r}"
                )
            raise
        executor = self.executor
        result = StepResult(
            loss=loss,
            microbatch_losses=losses,
            events=list(self.recorder.events),
            peak_activation_bytes=None if executor.meter is None else executor.meter.peak,
            duration=duration,
            w_tasks=executor.w_tasks,
            comm=None if self.comm is None else self.comm.last_stats,
            runtime_cpu=step_cpu - self._action_cpu,
            action_cpu=self._action_cpu,
        )
        executor.begin(None, None)
        if self.planner is not None:
            self.planner.observe(self, result)
        return result

    def _run(self, j: int, action: AnyAction) -> None:
        received: dict[Transfer, torch.Tensor] = {}
        comm = self.comm
        if comm is not None:
            incoming = self._receives[j]
            for transfer in incoming:
                received[transfer] = comm.receive(transfer, action)
            if not incoming:
                comm.flush(action)
            # Post the receives that now enter the window only now, so that at most prefetch_depth actions'
            # buffers are held (posting them before the wait above would hold one more during it).
            if j + self.prefetch_depth < len(self.actions):
                self._prefetch_for(j + self.prefetch_depth)
        # The recorder's action() block, inlined (this runs once per action); the named profiler range only
        # while a profiler records.
        with torch.profiler.record_function(self._names[j]) if profiler_active() else nullcontext():
            start, cpu = time.perf_counter(), time.thread_time()
            self._handlers[action.kind](self, action, received)
            self._action_cpu += time.thread_time() - cpu
            end = time.perf_counter()
        self.recorder.record(action, start, end)

    def _prefetch_for(self, j: int) -> None:
        """Post (without blocking) the receives of this rank's ``j``-th action."""
        action = self.actions[j]
        for transfer in self._receives[j]:
            self.comm.prefetch(transfer, action)

    def reset_shapes(self) -> None:
        """Let the next step's boundary tensors have new shapes (every pipeline rank must call it).

        The first step agrees each channel's shape and dtype through a small header; later steps reuse it, so
        that every receive is posted ahead of its use. A step whose stage output differs from it raises a
        ``ValueError`` naming the action unless this was called first.
        """
        if self.comm is not None:
            self.comm.reset_shapes()

    # -- collectives around the step ---------------------------------------------------------------------

    def _collective(self, start: Callable[[], dist.Work], what: str) -> None:
        """Start an asynchronous collective of the pipeline group and wait for it, bounded like every wait."""
        try:
            work = start()
        except Exception as exc:
            raise RuntimeError(
                f"pipeline rank {self.rank}: could not start {what} (did a rank crash?): {exc}"
            ) from exc
        self.comm.wait(work, what)

    def _barrier(self) -> None:
        self._collective(
            lambda: dist.barrier(group=self.pp_group, async_op=True),
            "the other pipeline ranks to reach the step's start barrier",
        )

    def _step_loss(self, losses: list[torch.Tensor]) -> torch.Tensor | None:
        mean = torch.stack(losses).to(torch.float64).mean().to(self.device) if losses else None
        if not (self.broadcast_loss and self._distributed):
            return mean
        buf = mean if mean is not None else torch.zeros((), dtype=torch.float64, device=self.device)
        src = self.schedule.rank_of(self.last_stage)
        src_global = src if self.pp_group is None else dist.get_global_rank(self.pp_group, src)
        self._collective(
            lambda: dist.broadcast(buf, src=src_global, group=self.pp_group, async_op=True),
            f"the step loss broadcast from rank {src}",
        )
        return buf

    # -- teardown ----------------------------------------------------------------------------------------

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
        if self._closed:
            return
        self._closed = True
        if self.comm is not None:
            self.comm.abort()
        self.comm = None
        self._pp_group = GroupRef(None, owner="PipelineRuntime.pp_group")
        for module in self.stages.values():
            close = getattr(module, "close", None)
            if callable(close):
                close()

    def __enter__(self) -> PipelineRuntime:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def parameters(self) -> list[nn.Parameter]:
        """The parameters of this rank's stages (each once), e.g. for its optimizer."""
        seen: dict[int, nn.Parameter] = {}
        for module in self.stages.values():
            for p in module.parameters():
                seen.setdefault(id(p), p)
        return list(seen.values())

    def zero_grad(self) -> None:
        """Reset this rank's gradients: ``zero_grad_buffer()`` of data-parallel stages, else ``.grad = None``."""
        for module in self.stages.values():
            zero = getattr(module, "zero_grad_buffer", None)
            if callable(zero):
                zero()
            else:
                module.zero_grad(set_to_none=True)

    def gather_timeline(self, result: StepResult, *, dst: int = 0) -> list[TimelineEvent] | None:
        """Merge every pipeline rank's events of ``result`` on rank ``dst`` (all ranks must call it)."""
        if not self._distributed:
            return list(result.events)
        return gather_events(result.events, group=self.pp_group, dst=dst)

    def timeline_report(
        self, result: StepResult, prefix: str | Path | None = None, *, dst: int = 0
    ) -> str | None:
        """Gather ``result``'s events; on rank ``dst`` return the measured-vs-simulated bubble line and, with
        ``prefix``, write ``<prefix>.json`` (Perfetto) and ``<prefix>.png`` (Gantt). All ranks must call it.
        """
        events = self.gather_timeline(result, dst=dst)
        if events is None:
            return None
        if not any(e.is_compute for e in events):
            raise ValueError("timeline_report: the step recorded no events (record_timeline=False?)")
        if prefix is not None:
            save_measured_timeline(events, self.schedule, prefix)
        report = bubble_report(events, self.schedule)
        plan = getattr(self.planner, "plan", None)
        if plan is not None and plan.schedule is self.schedule:
            report += f"; planned {100 * plan.predicted_bubble:.1f}% from the profiled costs"
        return report
