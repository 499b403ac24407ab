"""``ExpertParallelMoEGPT``: the MoE GPT with every MoE layer's experts sharded over a process group."""

from __future__ import annotations

import torch
import torch.distributed as dist

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

    Raises:
        ValueError: no ``ep_group``; its size does not divide ``num_experts``; an unknown ``experts`` kind.
    """

    def __init__(
        self,
        config: MoEConfig,
        *,
        ep_group: dist.ProcessGroup,
        dp_group: dist.ProcessGroup | None = None,
        experts: str = "module",
        device: torch.device | str | None = None,
    ) -> None:
        if ep_group is None:
            raise ValueError("ExpertParallelMoEGPT needs an ep_group; the single-process model is MoEGPT")

        def make_mlp(config: MoEConfig, layer: int) -> ExpertParallelMoEMLP:
            # Used during construction only: the layers look their groups up themselves, and a factory kept
            # on the model would hold the groups (and their gloo workers) past destroy_process_group().
            del layer
            return ExpertParallelMoEMLP(config, ep_group, dp_group, experts=experts)

        super().__init__(config, device=device, make_mlp=make_mlp)
