"""Load a single-process MoE model's weights into its expert-parallel twin (this rank's experts only)."""

from __future__ import annotations

import logging
import re

import torch
from torch import nn

from .layer import ExpertParallelMoEMLP

__all__ = ["load_full_state_dict"]

logger = logging.getLogger(__name__)

_EXPERT_KEY = re.compile(r"^(fc[12])\.(weight|bias)(\d+)$")


def load_full_state_dict(model: nn.Module, full_state: dict[str, torch.Tensor]) -> int:
    """Copy ``full_state`` (of the single-process model) into ``model``, an expert-parallel twin.

    Dense entries are copied as they are; expert ``j`` of an :class:`ExpertParallelMoEMLP` takes entry
    ``fcX.weight{expert_offset + j}`` of the full layer. Strict: every entry of ``model`` must be found.

    Args:
        model: the expert-parallel model (e.g. ``MoEGPT(config, ep_group=...)``).
        full_state: ``state_dict()`` of the same architecture built without expert parallelism.

    Returns:
        The number of expert tensors remapped.
    """
    offsets = {
        f"{name}.": m.expert_offset
        for name, m in model.named_modules()
        if isinstance(m, ExpertParallelMoEMLP)
    }
    mapped: dict[str, torch.Tensor] = {}
    remapped = 0
    for key in model.state_dict():
        source = key
        for prefix, offset in offsets.items():
            match = _EXPERT_KEY.match(key[len(prefix) :]) if key.startswith(prefix) else None
            if match is not None:
                fc, kind, j = match.groups()
                source = f"{prefix}{fc}.{kind}{offset + int(j)}"
                remapped += 1
                break
        if source not in full_state:
            raise ValueError(
                f"load_full_state_dict: {key!r} of the expert-parallel model needs {source!r}, which the full "
                f"state dict lacks (is it the same architecture? {len(full_state)} entries given)"
            )
        mapped[key] = full_state[source]
    model.load_state_dict(mapped, strict=True)
    return remapped
