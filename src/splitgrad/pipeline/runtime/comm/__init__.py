"""Point-to-point transport of the pipeline runtime: one :class:`PipelineComm` per rank.

:mod:`~.transport` sends and receives (the rules are in its docstring); what a schedule implies for one rank's
messages is derived once in ``_plan``, per-step bookkeeping is in ``_state``, the shape header a channel opens
with in ``_header``, and what one step's messages did in :mod:`~.stats` (:class:`CommStats`, returned in
:attr:`StepResult.comm <splitgrad.pipeline.runtime.StepResult.comm>`).
"""

from __future__ import annotations

from .stats import CommStats, ReceiveRecord
from .transport import PipelineComm

__all__ = ["CommStats", "PipelineComm", "ReceiveRecord"]
