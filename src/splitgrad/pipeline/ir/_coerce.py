"""Normalise the numbers users hand to the schedule entry points (``build_schedule``, ``simulate``).

Counts and costs often come from numpy or from arithmetic (``np.int64(8)``, ``memory_limit=8.0``,
``f=np.float32(1.2)``). At the public entry points they are turned into plain ``int``/``float`` once, so the
builders and the engine only ever see Python numbers: integral values of any numeric type are accepted for
counts, any finite real number for costs. Everything else — bools, fractional counts, NaN/inf, negatives,
strings — raises a ``ValueError`` naming the argument and the value. numpy is never imported (``numbers``
and ``operator.index`` recognise its scalars).
"""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Iterable
from typing import Any

__all__ = ["as_cost", "as_costs", "as_count", "as_counts", "normalize_schedule_args"]

# Options of the schedule families, by the kind of value they take.
_COUNT_OPTIONS = ("stages_per_rank",)
_COUNTS_OPTIONS = ("memory_limit", "warmup")  # one count, or one per rank
_COST_OPTIONS = ("f", "b", "w")  # one cost, or one per stage
_SCALAR_COST_OPTIONS = ("comm",)


def _is_bool(value: object) -> bool:
    # numpy.bool_ is neither a bool subclass nor Integral, but it is a bool all the same.
    return isinstance(value, bool) or type(value).__name__ in ("bool_", "bool")


def as_count(what: str, value: object, *, minimum: int = 1) -> int:
    """``value`` as an ``int >= minimum``: ints, numpy integers and integral floats (``8.0``) are accepted.

    Args:
        what: the argument's name for the message, e.g. ``"zb-auto: memory_limit"``.
        value: the user's value.
        minimum: smallest allowed value.

    Raises:
        ValueError: bool, non-number, fractional or non-finite float, or below ``minimum``.
    """
    count: int | None = None
    if not _is_bool(value):
        if isinstance(value, numbers.Integral):
            count = operator.index(value)
        elif isinstance(value, numbers.Real) and math.isfinite(value) and float(value).is_integer():
            count = int(value)
    if count is None or count < minimum:
        raise ValueError(f"{what} must be an integer >= {minimum}, got {value!r} ({type(value).__name__})")
    return count


def as_cost(what: str, value: object) -> float:
    """``value`` as a finite ``float >= 0`` (ints, floats, numpy scalars).

    Raises:
        ValueError: bool, non-number, NaN/inf or negative.
    """
    if _is_bool(value) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value < 0:
        raise ValueError(
            f"{what} must be finite and >= 0 (a real number), got {value!r} ({type(value).__name__})"
        )
    return float(value)


def as_costs(what: str, value: object) -> float | tuple[float, ...]:
    """One cost (a real number) or a sequence of them (one per stage), each as :func:`as_cost`.

    Raises:
        ValueError: naming ``what`` and the offending value.
    """
    if isinstance(value, numbers.Real) and not _is_bool(value):
        return as_cost(what, value)
    if isinstance(value, Iterable) and not isinstance(value, str | bytes):
        return tuple(as_cost(f"{what}[{i}]", v) for i, v in enumerate(value))
    raise ValueError(
        f"{what} must be a number or one number per stage, got {value!r} ({type(value).__name__})"
    )


def as_counts(what: str, value: object) -> int | tuple[int, ...]:
    """One count or a sequence of counts (one per rank), each as :func:`as_count`."""
    if isinstance(value, Iterable) and not isinstance(value, str | bytes):
        return tuple(as_count(f"{what}[{i}]", v) for i, v in enumerate(value))
    return as_count(what, value)


def per_rank_memory_limits(
    who: str, memory_limit: object, p: int, *, default: float, minimum: float, unit: str
) -> tuple[float, ...]:
    """``memory_limit`` (one real number, or one per rank; None -> ``default``) as ``p`` floats >= ``minimum``.

    Real numbers, numpy scalars too: under the paper's memory model (``w_memory < 1``) fractional limits mean
    something. :func:`as_costs` refuses bools, NaN/inf and negatives with the argument's name.

    Raises:
        ValueError: naming ``who``, the bound, ``unit`` and the value.
    """
    if memory_limit is None:
        return (float(default),) * p
    value = as_costs(f"{who}: memory_limit", memory_limit)
    limits = (value,) * p if isinstance(value, float) else value
    if len(limits) != p or any(x < minimum for x in limits):
        raise ValueError(
            f"{who}: memory_limit must be a number >= {minimum:g} ({unit}) or one per rank ({p} ranks), got "
            f"{memory_limit=}"
        )
    return tuple(float(x) for x in limits)


def normalize_schedule_args(
    name: str, n_stages: object, n_microbatches: object, options: dict[str, Any]
) -> tuple[int, int, dict[str, Any]]:
    """``build_schedule``'s arguments with every count an ``int`` and every cost a ``float``.

    Args:
        name: the schedule family (for the messages).
        n_stages: total model stages.
        n_microbatches: microbatches per step.
        options: the family's options; unknown ones pass through unchanged (the registry names them).

    Returns:
        ``(n_stages, n_microbatches, options)`` as plain Python numbers.

    Raises:
        ValueError: naming the argument and the value.
    """
    out = dict(options)
    for key, value in options.items():
        if value is None:
            continue
        if key in _COUNT_OPTIONS:
            out[key] = as_count(f"{name}: {key}", value)
        elif key in _COUNTS_OPTIONS:
            out[key] = as_counts(f"{name}: {key}", value)
        elif key in _COST_OPTIONS:
            out[key] = as_costs(f"{name}: {key}", value)
        elif key in _SCALAR_COST_OPTIONS:
            out[key] = as_cost(f"{name}: {key}", value)
    return as_count(f"{name}: n_stages", n_stages), as_count(f"{name}: n_microbatches", n_microbatches), out
