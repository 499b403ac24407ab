"""Name an expert-parallel model's tensors as the single-process model does, and load its weights.

:func:`full_state_names` maps each ``state_dict`` key of an expert-parallel model to the key of the same tensor
in the single-process :class:`~splitgrad.models.MoEGPT` (this rank's expert ``j`` is global expert
``expert_offset + j``); :func:`load_full_state_dict` loads the single-process weights through it, and a
checkpoint keys its tensors by it (:mod:`splitgrad.pipeline.checkpoint`), so that neither depends on the
expert-parallel size.
"""

from __future__ import annotations

import logging
import re
from typing import NamedTuple

import torch
from torch import nn

from .layer import ExpertParallelMoEMLP

__all__ = ["full_state_names", "load_full_state_dict"]

logger = logging.getLogger(__name__)

_EXPERT_KEY = re.compile(r"^(fc[12])\.(weight|bias)(\d*)$")


class _Source(NamedTuple):
    """Where a tensor of the expert-parallel model is in the single-process model."""

    name: str  # its key there
    rows: slice | None  # None: the whole tensor; a slice: this rank's rows of a single grouped expert tensor
    expert: bool  # an expert tensor of an ExpertParallelMoEMLP


def _full_sources(model: nn.Module) -> dict[str, _Source]:
    """Every ``state_dict`` key of ``model`` -> where its tensor is in the single-process model."""
    layers = {
        f"{name}.": (m.expert_offset, m.local_experts)
        for name, m in model.named_modules()
        if isinstance(m, ExpertParallelMoEMLP)
    }
    sources: dict[str, _Source] = {}
    for key in model.state_dict(keep_vars=True):
        sources[key] = _Source(key, None, expert=False)
        for prefix, (offset, local) in layers.items():
            match = _EXPERT_KEY.match(key[len(prefix) :]) if key.startswith(prefix) else None
            if match is not None:
                fc, kind, j = match.groups()
                if j:
                    sources[key] = _Source(f"{prefix}{fc}.{kind}{offset + int(j)}", None, expert=True)
                else:  # one grouped tensor: this rank's rows of the full one
                    sources[key] = _Source(f"{prefix}{fc}.{kind}", slice(offset, offset + local), expert=True)
                break
    return sources


def full_state_names(model: nn.Module) -> dict[str, str]:
    """Every ``state_dict`` key of ``model`` -> the key of the same tensor in the single-process model.

    Expert ``j`` of an :class:`ExpertParallelMoEMLP` (``fcX.weight{j}``, ``fcX.bias{j}``) is named by its global
    index ``expert_offset + j``; every other key (and every key of a model without expert parallelism) maps to
    itself.

    Raises:
        ValueError: an expert-parallel layer with one grouped weight (``moe_single_grouped_weight``): its
            ``fcX.weight`` holds only this rank's rows of the full tensor, which no single name says (a
            checkpoint keyed by it would let the ranks overwrite each other's experts).
    """
    names: dict[str, str] = {}
    for key, (source, rows, _) in _full_sources(model).items():
        if rows is not None:
            raise ValueError(
                f"full_state_names: {key!r} holds rows [{rows.start}, {rows.stop}) of the single-process "
                f"{source!r} (moe_single_grouped_weight under expert parallelism); name-keyed checkpoints need "
                "one tensor per expert: build the model with moe_single_grouped_weight=False"
            )
        names[key] = source
    return names


def load_full_state_dict(model: nn.Module, full_state: dict[str, torch.Tensor]) -> int:
    """Copy ``full_state`` (of the single-process model) into ``model``, an expert-parallel twin.

    Dense entries are copied as they are; expert ``j`` of an :class:`ExpertParallelMoEMLP` takes entry
    ``fcX.weight{expert_offset + j}`` of the full layer (:func:`full_state_names`); with
    ``moe_single_grouped_weight`` its one ``fcX.weight`` ``(local_experts, out, in)`` takes rows
    ``[expert_offset, expert_offset + local_experts)`` of the full layer's (biases alike). Both models must use
    the same layout (a checkpoint of the other one converts with
    ``splitgrad.functional.grouped_layout.convert_grouped_state_dict``). Strict: every entry of ``model`` must
    be found.

    Args:
        model: the expert-parallel model (e.g. ``MoEGPT(config, ep_group=...)``).
        full_state: ``state_dict()`` of the same architecture built without expert parallelism.

    Returns:
        The number of expert tensors taken from the full layers (a single grouped tensor counts once).

    Raises:
        ValueError: an entry is missing from ``full_state``, or a single grouped tensor has too few experts.
    """
    mapped: dict[str, torch.Tensor] = {}
    remapped = 0
    for key, (source, rows, expert) in _full_sources(model).items():
        remapped += expert
        if source not in full_state:
            raise ValueError(
                f"load_full_state_dict: {key!r} of the expert-parallel model needs {source!r}, which the full "
                f"state dict lacks (is it the same architecture and expert layout? {len(full_state)} entries given)"
            )
        value = full_state[source]
        if rows is not None:
            if value.shape[0] < rows.stop:
                raise ValueError(
                    f"load_full_state_dict: {source!r} has {value.shape[0]} experts, {key!r} needs rows "
                    f"[{rows.start}, {rows.stop})"
                )
            value = value[rows]
        mapped[key] = value
    model.load_state_dict(mapped, strict=True)
    return remapped
