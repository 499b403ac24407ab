"""The runtime: a :class:`~splitgrad.pipeline.ir.actions.Schedule` run on torch.distributed, one rank at a time.

:func:`build_runtime` (:mod:`~.build`) cuts and wraps the stages and lowers the schedule;
:class:`PipelineRuntime` (:mod:`~.pipeline_runtime`) only interprets it, each action kind through its handler
(:mod:`~.handlers`), computing on :class:`~.executor.StageExecutor` and moving messages over
:class:`~.comm.PipelineComm`; :mod:`~.recording` times the actions, and :mod:`~.autoplan` plans ``zb-auto`` from
measured costs. Everything here imports torch; the schedules it runs do not.
"""

from __future__ import annotations

from .build import PipelineGroups, build_runtime, pipeline_groups, sequential_stages
from .pipeline_runtime import PipelineRuntime
from .result import StepResult

__all__ = [
    "PipelineGroups",
    "PipelineRuntime",
    "StepResult",
    "build_runtime",
    "pipeline_groups",
    "sequential_stages",
]
