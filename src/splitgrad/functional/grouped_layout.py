"""The two parameter layouts of a grouped linear (TE's names), shared by ``GroupedLinear`` and ``ops.GroupedLinear``.

* per group: ``weight0 .. weight{n-1}`` ``(out, in)`` and ``bias0 .. bias{n-1}`` ``(out,)``;
* single (TE >= 2.14 ``single_grouped_weight`` / ``single_grouped_bias``, Megatron-Core's
  ``moe_single_grouped_weight``): one ``weight`` ``(n, out, in)`` and one ``bias`` ``(n, out)``.

The weight and the bias choose their layout independently, as in TE. :func:`convert_grouped_state_dict`
rewrites a checkpoint from one layout to the other, in both directions.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence

import torch
from torch import nn

from .grouped_wgrad import GroupedParams

__all__ = [
    "convert_grouped_state_dict",
    "grouped_biases",
    "grouped_pairs",
    "grouped_params_of",
    "register_grouped_parameters",
]


def register_grouped_parameters(
    module: nn.Module,
    num_groups: int,
    shape: tuple[int, int],
    *,
    bias: bool,
    single_weight: bool,
    single_bias: bool,
    factory: dict,
    interleave: bool = True,
    absent_as_none: bool = False,
) -> None:
    """Register the (uninitialised) weights and biases of a grouped linear on ``module``.

    Args:
        module: the layer.
        num_groups: groups (experts).
        shape: one group's weight ``(out, in)``.
        bias, single_weight, single_bias: what to register and in which layout.
        factory: ``dtype``/``device`` keyword arguments.
        interleave: per-group order ``weight0, bias0, weight1, ..`` (the module's) instead of all weights
            then all biases (the op's); the single parameters come weight first either way.
        absent_as_none: without ``bias``, register the bias names as None (the module's TE behaviour).
    """
    out, inp = shape
    if single_weight:
        weights = [("weight", (num_groups, out, inp))]
    else:
        weights = [(f"weight{g}", shape) for g in range(num_groups)]
    if single_bias or (single_weight and not bias):
        biases = [("bias", (num_groups, out))]
    else:
        biases = [(f"bias{g}", (out,)) for g in range(num_groups)]
    if not bias:
        # TE registers absent biases as None (state_dict skips them); the op registers none at all.
        biases = [(name, None) for name, _ in biases] if absent_as_none else []
    order = weights + biases
    if interleave and len(weights) == len(biases) > 1:
        order = [item for pair in zip(weights, biases) for item in pair]
    for name, size in order:
        module.register_parameter(name, None if size is None else nn.Parameter(torch.empty(size, **factory)))


def grouped_params_of(
    module: nn.Module,
    num_groups: int,
    tensors: Sequence[torch.Tensor] | None = None,
    *,
    single_weight: bool,
    single_bias: bool,
    bias: bool,
) -> GroupedParams:
    """``module``'s grouped parameters as a :class:`GroupedParams` (weights first, then biases).

    Args:
        module: the layer that registered them with :func:`register_grouped_parameters`.
        num_groups, single_weight, single_bias, bias: its layout.
        tensors: stand-ins in :attr:`GroupedParams.tensors` order (e.g. autocast copies a Function received).
    """
    if tensors is None:
        tensors = [getattr(module, n) for n in _grouped_names(num_groups, single_weight, single_bias, bias)]
    n_w = 1 if single_weight else num_groups
    weight = tensors[0] if single_weight else list(tensors[:n_w])
    rest = list(tensors[n_w:])
    bias_part = None if not rest else rest[0] if single_bias else rest
    return GroupedParams(weight, bias_part)


# Called on every forward and backward: the names are built once per layout (immutable tuples).
@functools.cache
def _grouped_names(num_groups: int, single_weight: bool, single_bias: bool, bias: bool) -> tuple[str, ...]:
    names = ["weight"] if single_weight else [f"weight{g}" for g in range(num_groups)]
    if bias:
        names += ["bias"] if single_bias else [f"bias{g}" for g in range(num_groups)]
    return tuple(names)


def grouped_biases(params: GroupedParams, num_groups: int) -> list[torch.Tensor | None]:
    """One bias per group: the per-group parameters, views of the single one, or Nones."""
    if params.bias is None:
        return [None] * num_groups
    return list(params.bias.unbind(0)) if isinstance(params.bias, torch.Tensor) else list(params.bias)


def grouped_pairs(params: GroupedParams, num_groups: int) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """``(weight_g, bias_g)`` per group (views where the layout is single), in group order."""
    weights = params.weight.unbind(0) if isinstance(params.weight, torch.Tensor) else params.weight
    return list(zip(weights, grouped_biases(params, num_groups)))


def convert_grouped_state_dict(
    state_dict: Mapping[str, torch.Tensor],
    num_gemms: int,
    *,
    single_grouped_weight: bool,
    single_grouped_bias: bool | None = None,
    prefix: str = "",
) -> dict[str, torch.Tensor]:
    """A copy of ``state_dict`` with one grouped linear's entries rewritten into the requested layout.

    Works in both directions and on either part alone (a checkpoint may already have the requested layout for
    one of them). Splitting a single tensor returns views of it (no copy); stacking copies. Every other entry
    is passed through unchanged, in order.

    Args:
        state_dict: a ``state_dict()`` of a model holding the layer (or of the layer itself).
        num_gemms: the layer's number of groups.
        single_grouped_weight: the target layout of the weight (``weight`` ``(n, out, in)`` or ``weight0 ..``).
        single_grouped_bias: the target layout of the bias (default: as the weight). Ignored without a bias.
        prefix: the layer's key prefix, with its trailing dot (``"layers.0.experts.fc1."``).

    Returns:
        The rewritten dict (``load_state_dict`` into a layer of the target layout takes it as is).

    Raises:
        ValueError: the entries under ``prefix`` are missing, incomplete, or disagree with ``num_gemms``.

    Example::

        sd = convert_grouped_state_dict(old.state_dict(), 8, single_grouped_weight=True)
        new.load_state_dict(sd)  # new = GroupedLinear(8, ..., single_grouped_weight=True, single_grouped_bias=True)
    """
    if single_grouped_bias is None:
        single_grouped_bias = single_grouped_weight
    out = dict(state_dict)
    _regroup(out, num_gemms, prefix, "weight", single_grouped_weight, required=True)
    _regroup(out, num_gemms, prefix, "bias", single_grouped_bias, required=False)
    return out


def _regroup(sd: dict, n: int, prefix: str, part: str, single: bool, *, required: bool) -> None:
    """Rewrite ``{prefix}{part}`` / ``{prefix}{part}0..`` of ``sd`` in place into the requested layout."""
    one = f"{prefix}{part}"
    many = [f"{prefix}{part}{g}" for g in range(n)]
    present = [k for k in many if k in sd]
    if one in sd and present:
        raise ValueError(f"convert_grouped_state_dict: both {one!r} and {present[0]!r} are present")
    if one not in sd and not present:
        if required:
            near = [k for k in sd if k.startswith(prefix)][:6]
            raise ValueError(
                f"convert_grouped_state_dict: no {one!r} nor {many[0]!r} .. {many[-1]!r} in the state dict "
                f"(wrong prefix={prefix!r}? keys under it: {near})"
            )
        return
    if one in sd:
        if sd[one].shape[0] != n:
            raise ValueError(
                f"convert_grouped_state_dict: {one!r} has shape {tuple(sd[one].shape)}, not {n} groups ({n=})"
            )
        if not single:
            _replace(sd, [one], dict(zip(many, sd[one].unbind(0))))
        return
    if len(present) != n:
        missing = [k for k in many if k not in sd]
        raise ValueError(f"convert_grouped_state_dict: {len(missing)} of {n} entries missing: {missing[:4]}")
    if single:
        _replace(sd, many, {one: torch.stack([sd[k] for k in many])})


def _replace(sd: dict, old: list[str], new: dict[str, torch.Tensor]) -> None:
    """Replace the entries ``old`` by ``new`` at the position of the first of them, keeping the others' order."""
    items = list(sd.items())
    at = next(i for i, (k, _) in enumerate(items) if k in old)
    kept = [(k, v) for k, v in items if k not in old]
    before = sum(1 for k, _ in items[:at] if k not in old)
    sd.clear()
    sd.update(kept[:before] + list(new.items()) + kept[before:])
