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

import torch
from torch import nn

from .layer import ExpertParallelMoEMLP

__all__ = ["full_state_names", "load_full_state_dict"]

logger = logging.getLogger(__name__)

_EXPERT_KEY = re.compile(r"^(fc[12])\.(weight|bias)(\d+)$")


def full_state_names(model: nn.Module) -> dict[str, str]:
    """Every ``state_dict`` key of ``model`` -> the key of the same tensor in the single-process model.

    Expert ``j`` of an :class:`ExpertParallelMoEMLP` (``fcX.weight{j}``, ``fcX.bias{j}``) is named by its global
    index ``expert_offset + j``; every other key (and every key of a model without expert parallelism) maps to
    itself.
    """
    offsets = {
        f"{name}.": m.expert_offset
        for name, m in model.named_modules()
        if isinstance(m, ExpertParallelMoEMLP)
    }
    names: dict[str, str] = {}
    for key in model.state_dict(keep_vars=True):
        names[key] = key
        for prefix, offset in offsets.items():
            match = _EXPERT_KEY.match(key[len(prefix) :]) if key.startswith(prefix) else None
            if match is not None:
                fc, kind, j = match.groups()
                names[key] = f"{prefix}{fc}.{kind}{offset + int(j)}"
                break
    return names


def load_full_state_dict(model: nn.Module, full_state: dict[str, torch.Tensor]) -> int:
    """Copy ``full_state`` (of the single-process model) into ``model``, an expert-parallel twin.

    Dense entries are copied as they are; expert ``j`` of an :class:`ExpertParallelMoEMLP` takes entry
    ``fcX.weight{expert_offset + j}`` of the full layer (:func:`full_state_names`). Strict: every entry of
    ``model`` must be found.

    Args:
        model: the expert-parallel model (e.g. ``MoEGPT(config, ep_group=...)``).
        full_state: ``state_dict()`` of the same architecture built without expert parallelism.

    Returns:
        The number of expert tensors remapped.
    """
    mapped: dict[str, torch.Tensor] = {}
    remapped = 0
    for key, source in full_state_names(model).items():
        remapped += source != key
        if source not in full_state:
            raise ValueError(
                f"load_full_state_dict: {key!r} of the expert-parallel model needs {source!r}, which the full "
                f"state dict lacks (is it the same architecture? {len(full_state)} entries given)"
            )
        mapped[key] = full_state[source]
    model.load_state_dict(mapped, strict=True)
    return remapped
