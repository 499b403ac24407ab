"""Schedule families by name: :func:`build_schedule` and :func:`schedule_names`.

``SCHEDULES`` (the name -> builder table) stays exported here only because ``splitgrad.pipeline.SCHEDULES``, a
deprecated name, points to it; list the families with :func:`schedule_names`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from types import MappingProxyType
from typing import Any

from ..ir._coerce import normalize_schedule_args
from ..ir.actions import Schedule
from .auto import zb_auto
from .dualpipev import dualpipev
from .gpipe_1f1b import gpipe, one_f_one_b
from .interleaved import interleaved_1f1b
from .v_half import v_half
from .v_min import v_min
from .zbv import zbv
from .zbv_auto import zbv_auto
from .zero_bubble import zb_h1, zb_h2

__all__ = ["SCHEDULES", "build_schedule", "schedule_names", "schedule_options"]

SCHEDULES: MappingProxyType[str, Callable[..., Schedule]] = MappingProxyType(
    {
        "gpipe": gpipe,
        "1f1b": one_f_one_b,
        "interleaved-1f1b": interleaved_1f1b,
        "zb-h1": zb_h1,
        "zb-h2": zb_h2,
        "zbv": zbv,
        "dualpipev": dualpipev,
        "zb-auto": zb_auto,
        "zbv-auto": zbv_auto,
        "v-half": v_half,
        "v-min": v_min,
    }
)
"""Read-only map from schedule name to its builder ``(n_stages, n_microbatches, **options) -> Schedule``."""

_ALIASES = MappingProxyType(
    {
        "interleaved": "interleaved-1f1b",
        "zb-v": "zbv",
        "zb-v-auto": "zbv-auto",
        "zbh1": "zb-h1",
        "zbh2": "zb-h2",
        "vhalf": "v-half",
        "vmin": "v-min",
    }
)


def schedule_names() -> tuple[str, ...]:
    """Names accepted by :func:`build_schedule`."""
    return tuple(SCHEDULES)


def schedule_options(name: str) -> tuple[str, ...]:
    """Keyword options the schedule ``name`` accepts."""
    builder = SCHEDULES[_ALIASES.get(name, name)]
    return tuple(
        p.name
        for p in inspect.signature(builder).parameters.values()
        if p.kind is inspect.Parameter.KEYWORD_ONLY
    )


def build_schedule(name: str, n_stages: int, n_microbatches: int, **options: Any) -> Schedule:
    """Build the schedule family ``name`` for ``n_stages`` model stages and ``n_microbatches`` microbatches.

    ``n_stages`` counts model stages, as in ``torch.distributed.pipelining``; families with several stages
    per rank use ``n_stages / stages_per_rank`` ranks (``zbv``, ``zbv-auto``, ``dualpipev``, ``v-half`` and ``v-min``:
    2; ``interleaved-1f1b``: option ``stages_per_rank``, default 2).

    Args:
        name: one of :func:`schedule_names` (``"gpipe"``, ``"1f1b"``, ``"interleaved-1f1b"``, ``"zb-h1"``,
            ``"zb-h2"``, ``"zbv"``, ``"dualpipev"``, ``"zb-auto"``, ``"zbv-auto"``, ``"v-half"``, ``"v-min"``).
        n_stages: total model stages.
        n_microbatches: microbatches per step.
        **options: family options: ``split_backward`` (gpipe, 1f1b, interleaved-1f1b), ``stages_per_rank``
            (interleaved-1f1b), ``overlap`` (dualpipev: overlapped ``F+BW`` pairs, default True),
            ``pair_last_rank_first`` (dualpipev: pair the last rank's first F and BW too, default False),
            ``f``/``b``/``w``/``comm``/``memory_limit``/``w_memory`` (zb-auto; ``memory_limit`` in units of one
            activation ``M_B``, ``w_memory = M_W / M_B`` the paper's memory model); the same for zbv-auto (the
            cost-aware ZB-V, ``memory_limit`` in stage activations, default ``n_stages``).

    Counts (``n_stages``, ``n_microbatches``, ``stages_per_rank``, ``memory_limit``, ``warmup``) may be any
    integral number (``8``, ``numpy.int64(8)``, ``8.0``); costs any finite real number (``numpy.float32``).

    Raises:
        ValueError: unknown name or option, a bool, fractional, non-finite or negative number (naming the
            argument and its value), or counts the family cannot schedule.
    """
    if not isinstance(name, str):
        raise ValueError(
            f"schedule name must be a string, got {name!r}; choose one of {', '.join(SCHEDULES)}"
        )
    key = _ALIASES.get(name.lower(), name.lower())
    if key not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULES)}")
    accepted = schedule_options(key)
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise ValueError(
            f"schedule {key!r} does not take option(s) {unknown}; it accepts {list(accepted) or 'no options'}"
        )
    n_stages, n_microbatches, options = normalize_schedule_args(key, n_stages, n_microbatches, options)
    return SCHEDULES[key](n_stages, n_microbatches, **options)
