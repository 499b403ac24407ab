"""Validation of a layer's sizes (every module and op) and of per-group row counts (``m_splits`` /
``split_sizes``, both GroupedLinear APIs).

A grouped GEMM silently computing garbage is the worst failure an MoE layer can have, so sizes are checked
strictly: integers only (``2.0`` is refused rather than truncated — a float size almost always means a
router computed fractions), no bools, one per group, non-negative, summing to the number of rows.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Sequence

import torch

__all__ = ["check_positive_sizes", "check_split_sizes"]


def check_positive_sizes(label: str, **sizes: int) -> None:
    """Raise ``ValueError`` (``"<label> needs positive sizes, got a=.. b=.."``) unless every size is > 0.

    Args:
        label: the layer as the message names it (``"Linear"``, ``"ops.BasicLinear"``).
        **sizes: the constructor's size arguments, in the order the message lists them.
    """
    if any(size <= 0 for size in sizes.values()):
        got = " ".join(f"{name}={size!r}" for name, size in sizes.items())
        raise ValueError(f"{label} needs positive sizes, got {got}")


def _is_integer_dtype(dtype: torch.dtype) -> bool:
    """Whether ``dtype`` holds integers: not floating point, not complex, not bool."""
    return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)


def _as_int(value: object) -> int | None:
    """``value`` as an int if it is an integer (Python, numpy or 0-d integer tensor), else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, torch.Tensor):
        if value.dim() != 0 or not _is_integer_dtype(value.dtype):
            return None
        return int(value.item())
    try:
        return operator.index(value)  # int, numpy integers; refuses floats, numpy bools and sequences
    except TypeError:
        return None


def check_split_sizes(
    owner: str | Callable[[], str],
    arg: str,
    sizes: Sequence[int] | torch.Tensor,
    num_groups: int,
    tokens: int,
) -> list[int]:
    """``sizes`` as a list of ``num_groups`` non-negative ints summing to ``tokens``.

    Args:
        owner: the module's description, for the messages, or a function making it (called only to raise:
            a layer checks its sizes on every call).
        arg: the argument's name (``"m_splits"`` or ``"split_sizes"``).
        sizes: a sequence of integers (Python or numpy) or a 1-D integer tensor ``(num_groups,)`` (read once on the host, as
            TE's grouped GEMM needs host sizes).
        num_groups: number of groups the layer has.
        tokens: number of input rows.

    Returns:
        The sizes as Python ints.

    Raises:
        ValueError: naming ``owner``, ``arg`` and the offending values.
    """
    # The common case (a list of Python ints that fits), checked without building any message.
    plain = type(sizes) is list and len(sizes) == num_groups
    if plain and all(type(s) is int and s >= 0 for s in sizes) and sum(sizes) == tokens:
        return list(sizes)
    owner = owner() if callable(owner) else owner
    if isinstance(sizes, torch.Tensor):
        if sizes.dim() != 1 or not _is_integer_dtype(sizes.dtype):
            raise ValueError(
                f"{owner}: {arg} tensor must be 1-D with an integer dtype, got dtype={sizes.dtype} "
                f"shape={tuple(sizes.shape)}: {sizes.tolist()}"
            )
        if sizes.device.type == "meta":
            raise ValueError(f"{owner}: a {arg} tensor on the meta device has no values; pass a list of ints")
        values: list[int | None] = [int(s) for s in sizes.tolist()]
    elif isinstance(sizes, Iterable) and not isinstance(sizes, str | bytes):
        items = list(sizes)  # lists, tuples, numpy arrays (their rows, when 2-D, are refused below)
        values = [_as_int(s) for s in items]
        bad = [(i, s) for i, (s, v) in enumerate(zip(items, values)) if v is None]
        if bad:
            i, s = bad[0]
            raise ValueError(
                f"{owner}: {arg} must be a flat sequence of integers, got {arg}={items!r} "
                f"(element {i} is {type(s).__name__} {s!r}: floats, bools and nested sizes are refused, never truncated)"
            )
    else:
        raise ValueError(
            f"{owner}: {arg} must be a sequence of ints or a 1-D integer tensor, got {type(sizes).__name__} "
            f"{sizes!r}"
        )
    ints = [int(v) for v in values if v is not None]
    if len(ints) != num_groups or any(s < 0 for s in ints) or sum(ints) != tokens:
        raise ValueError(
            f"{owner}: {arg} must be {num_groups} non-negative ints summing to the {tokens} input rows, "
            f"got {arg}={ints} (len={len(ints)}, sum={sum(ints)})"
        )
    return ints
