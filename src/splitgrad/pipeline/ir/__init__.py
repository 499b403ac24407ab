"""The schedule IR: actions and schedules as data, their validation, and the simulator that times them.

Torch-free: a schedule is built, checked and simulated without a process or a tensor. :mod:`~.actions` holds
the grammar (``Action``, ``OverlapAction``, ``Schedule``, ``parse_action``), :mod:`~.validate` the checks
(completeness, order, deadlock), :mod:`~.simulate` the timing and memory model; the engine both share
(``_engine``) runs a schedule under the blocking model once, for any per-action durations.
"""

from __future__ import annotations

from .actions import (
    COMPUTE_KINDS,
    SYNC_KINDS,
    Action,
    ActionKind,
    AnyAction,
    OverlapAction,
    Schedule,
    ScheduleError,
    Transfer,
    parse_action,
)
from .simulate import Costs, SimulationResult, simulate
from .validate import channel_order_problems, find_problems, render_listing, validate

__all__ = [
    "COMPUTE_KINDS",
    "SYNC_KINDS",
    "Action",
    "ActionKind",
    "AnyAction",
    "Costs",
    "OverlapAction",
    "Schedule",
    "ScheduleError",
    "SimulationResult",
    "Transfer",
    "channel_order_problems",
    "find_problems",
    "parse_action",
    "render_listing",
    "simulate",
    "validate",
]
