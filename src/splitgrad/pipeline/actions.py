"""Public path of the action grammar: ``splitgrad.pipeline.actions`` as documented before issue 24.

The module lives in :mod:`splitgrad.pipeline.ir.actions` (the IR room); this alias keeps ``from
splitgrad.pipeline.actions import parse_action`` working for users and other packages' docs. New code imports
from :mod:`splitgrad.pipeline.ir`.
"""

from __future__ import annotations

from .ir.actions import (
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

__all__ = [
    "COMPUTE_KINDS",
    "SYNC_KINDS",
    "Action",
    "ActionKind",
    "AnyAction",
    "OverlapAction",
    "Schedule",
    "ScheduleError",
    "Transfer",
    "parse_action",
]
