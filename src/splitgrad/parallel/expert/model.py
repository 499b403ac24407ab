"""``ExpertParallelMoEGPT``: the MoE GPT with every MoE layer's experts sharded over a process group."""

from __future__ import annotations

import torch
from torch import nn

from ...models.config import MoEConfig
from ...models.moe import MoEGPT
from .layer import ExpertParallelMoEMLP

__all__ = ["ExpertParallelMoEGPT"]


class ExpertParallelMoEGPT(MoEGPT):
    """:class:`splitgrad.models.MoEGPT` whose MoE layers are :class:`ExpertParallelMoEMLP`.

    Rank ``r`` of ``ep_group`` owns experts ``[r * E / ep, (r + 1) * E / ep)``; tokens go to their experts' ranks
    and back with all-to-all. Load the single-process reference's weights with :func:`load_full_state_dict`.

    Args:
        config: the MoE model configuration.
        ep_group: the expert-parallel process group.
        dp_group: every rank whose tokens form the global batch (default ``ep_group``).
        experts: ``"module"`` (``splitgrad.GroupedLinear``) or ``"ops"`` (``splitgrad.ops.GroupedLinear``).
        device: parameter device.
    """

    def __init__(
        self,
        config: MoEConfig,
        *,
        ep_group: object,
        dp_group: object | None = None,
        experts: str = "module",
        device: torch.device | str | None = None,
    ) -> None:
        if ep_group is None:
            raise ValueError("ExpertParallelMoEGPT needs an ep_group; the single-process model is MoEGPT")
        # Read by _make_mlp, which GPT.__init__ calls before this class could set attributes normally.
        object.__setattr__(self, "_expert_parallel", (ep_group, dp_group, experts))
        try:
            super().__init__(config, device=device)
        finally:
            # Needed only while the layers are built: kept, it would hold the groups (and their gloo workers)
            # past destroy_process_group(); the layers look them up themselves.
            object.__delattr__(self, "_expert_parallel")

    def _make_mlp(self, config: MoEConfig, layer: int) -> nn.Module:  # type: ignore[override]
        del layer
        ep_group, dp_group, experts = self._expert_parallel
        return ExpertParallelMoEMLP(config, ep_group, dp_group, experts=experts)
