"""The MoE router: a bias-free splitgrad ``Linear`` (``hidden -> num_experts``) with the top-k choice and the
load-balancing loss, shared by the single-process :class:`~splitgrad.models.MoEMLP` and the expert-parallel
layer (:class:`splitgrad.parallel.expert.ExpertParallelMoEMLP`).

It *is* the gate projection (as Megatron-Core's ``TopKRouter`` owns its weight), so its parameter stays
``router.weight`` in both layers' state dicts and its weight gradient defers like any splitgrad layer's.
"""

from __future__ import annotations

import torch

from ..module.linear import Linear
from .config import MoEConfig
from .gpt import split_kwargs

__all__ = ["TopKRouter", "balanced_experts"]


def balanced_experts(
    tokens: int, top_k: int, num_experts: int, device: torch.device | None = None
) -> torch.Tensor:
    """The forced-balance routing (``MoEConfig.router_force_load_balancing``): ``(tokens, top_k)`` int64, copy
    ``j`` of token ``t`` to expert ``(t * top_k + j) % num_experts`` (distinct per token since ``top_k <=
    num_experts``)."""
    slots = torch.arange(tokens * top_k, device=device).view(tokens, top_k)
    return slots % num_experts


class TopKRouter(Linear):
    """Scores ``h: (T, hidden)`` against every expert and picks each token's top-k (dropless).

    Args:
        config: ``num_experts``, ``top_k``, ``norm_topk_prob``, ``router_force_load_balancing``,
            ``aux_loss_coef`` and the split keywords (``delay_wgrad_compute``, ...) of the model.
    """

    def __init__(self, config: MoEConfig) -> None:
        super().__init__(config.hidden_size, config.num_experts, False, **split_kwargs(config))
        self.num_experts = config.num_experts
        self.top_k = config.top_k
        self.norm_topk_prob = config.norm_topk_prob
        self.force_load_balancing = config.router_force_load_balancing
        self.aux_loss_coef = config.aux_loss_coef

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Router probabilities and the top-k choice of ``h: (T, hidden)``.

        Returns:
            ``(probs, weights, experts)``: ``probs: (T, E)`` softmax in at least fp32, ``weights: (T, k)`` in
            ``h``'s dtype, ``experts: (T, k)`` int64 (the round-robin choice of
            ``MoEConfig.router_force_load_balancing`` when it is set, the top-k of ``probs`` otherwise).
        """
        logits = self(h)
        probs = torch.softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
        if self.force_load_balancing:
            experts = balanced_experts(h.shape[0], self.top_k, self.num_experts, h.device)
            weights = probs.gather(1, experts)
        else:
            weights, experts = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        return probs, weights.to(h.dtype), experts

    def aux_loss(self, probs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """``coef * E * sum_i f_i * P_i`` for ``probs: (T, E)`` and ``counts: (E,)`` routed copies per expert
        (Switch/GShard: ``f_i`` the fraction of routed copies sent to expert ``i``, ``P_i`` its mean router
        probability); a scalar."""
        tokens = probs.shape[0]
        f = counts.to(probs.dtype) / (tokens * self.top_k)
        return self.aux_loss_coef * self.num_experts * (f * probs.mean(0)).sum()

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, top_k={self.top_k}"
