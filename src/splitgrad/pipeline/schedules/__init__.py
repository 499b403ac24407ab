"""Schedule builders, one module per family, and the name registry: :func:`build_schedule` builds by name,
:func:`schedule_names` is the one way to list the names (``registry.SCHEDULES`` is its private table);
:func:`frontier` compares the families' memory and bubble."""

from __future__ import annotations

from .auto import AutoCandidate, auto_candidates, greedy_schedule, zb_auto
from .dualpipev import dualpipev
from .frontier import Frontier, FrontierPoint, frontier
from .gpipe_1f1b import gpipe, one_f_one_b
from .interleaved import interleaved_1f1b
from .registry import build_schedule, schedule_names, schedule_options
from .v_half import v_half
from .v_min import v_min
from .zbv import zbv
from .zbv_auto import ZbvCandidate, zbv_auto, zbv_auto_candidates
from .zero_bubble import zb_h1, zb_h2

__all__ = [
    "AutoCandidate",
    "Frontier",
    "FrontierPoint",
    "ZbvCandidate",
    "auto_candidates",
    "build_schedule",
    "dualpipev",
    "frontier",
    "gpipe",
    "greedy_schedule",
    "interleaved_1f1b",
    "one_f_one_b",
    "schedule_names",
    "schedule_options",
    "v_half",
    "v_min",
    "zb_auto",
    "zb_h1",
    "zb_h2",
    "zbv",
    "zbv_auto",
    "zbv_auto_candidates",
]
