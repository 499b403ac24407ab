"""Load a single-process MoE model's weights into its expert-parallel twin (this rank's experts only)."""

from __future__ import annotations

import logging
import re

import torch
from torch import nn

from .layer import ExpertParallelMoEMLP

__all__ = ["load_full_state_dict"]

logger = logging.getLogger(__name__)

_EXPERT_KEY = re.compile(r"^(fc[12])\.(weight|bias)(\d*)$")


def load_full_state_dict(model: nn.Module, full_state: dict[str, torch.Tensor]) -> int:
    """Copy ``full_state`` (of the single-process model) into ``model``, an expert-parallel twin.

    Dense entries are copied as they are; expert ``j`` of an :class:`ExpertParallelMoEMLP` takes entry
    ``fcX.weight{expert_offset + j}`` of the full layer; with ``moe_single_grouped_weight`` its one ``fcX.weight``
    ``(local_experts, out, in)`` takes rows ``[expert_offset, expert_offset + local_experts)`` of the full
    layer's (biases alike). Both models must use the same layout (a checkpoint of the other one converts with
    ``splitgrad.functional.grouped_layout.convert_grouped_state_dict``). Strict: every entry of ``model`` must
    be found.

    Args:
        model: the expert-parallel model (e.g. ``MoEGPT(config, ep_group=...)``).
        full_state: ``state_dict()`` of the same architecture built without expert parallelism.

    Returns:
        The number of expert tensors remapped (a single grouped tensor counts once).

    Raises:
        ValueError: an entry is missing from ``full_state``, or a single grouped tensor has too few experts.
    """
    layers = {
        f"{name}.": (m.expert_offset, m.local_experts)
        for name, m in model.named_modules()
        if isinstance(m, ExpertParallelMoEMLP)
    }
    mapped: dict[str, torch.Tensor] = {}
    remapped = 0
    for key in model.state_dict():
        source, rows = key, None
        for prefix, (offset, local) in layers.items():
            match = _EXPERT_KEY.match(key[len(prefix) :]) if key.startswith(prefix) else None
            if match is not None:
                fc, kind, j = match.groups()
                if j:
                    source = f"{prefix}{fc}.{kind}{offset + int(j)}"
                else:  # one grouped tensor: this rank's rows of the full one
                    source, rows = f"{prefix}{fc}.{kind}", slice(offset, offset + local)
                remapped += 1
                break
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
