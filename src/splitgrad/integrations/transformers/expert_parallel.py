"""A transformers v5 MoE model's experts sharded over an expert-parallel group, through splitgrad's dispatcher.

:func:`shard_hf_experts` replaces every converted experts module (``splitgrad.convert`` first) by an
:class:`ExpertParallelExperts`: this rank keeps experts ``[offset, offset + E / ep)`` as a converted experts
module of the same class holding only those rows of ``gate_up_proj`` / ``down_proj`` (and biases), and its forward
moves the token copies to their experts' ranks and back with splitgrad's
:class:`~splitgrad.parallel.expert.dispatcher.AllToAllDispatcher` (the same exchange as
:class:`~splitgrad.parallel.expert.ExpertParallelMoEMLP`)::

    rows, order = permute_tokens(h, top_k_index)        # sorted by global expert = grouped by owning rank
    rows, m_splits = dispatcher.dispatch(rows)          # to the experts' ranks, grouped by local expert
    y = local_experts(rows, local ids, weight 1)        # the family's own expert math, W deferrable
    out = unpermute_tokens(combine(y), order, top_k_weights)

The router (the MoE block's ``gate``) and everything else stay replicated; the MoE block calls the replacement
with the same ``(hidden_states, top_k_index, top_k_weights)``. Because the local module is the family's own
converted experts module, every family ``convert`` handles (transposed, biased, clamped or softcapped gates)
shards the same way. Expert parameters are marked ``expert_parallel`` for
:class:`~splitgrad.parallel.expert.ExpertDataParallel`.
"""

from __future__ import annotations

import copy
import logging

import torch
import torch.distributed as dist
from torch import nn

from ...core.steps import run_steps
from ...models.experts import permute_tokens, unpermute_tokens
from ...parallel.expert.dispatch_wgrad import run_expert_wgrad
from ...parallel.expert.dispatcher import AllToAllDispatcher
from .experts import SplitExperts

__all__ = ["ExpertParallelExperts", "shard_hf_experts"]

logger = logging.getLogger(__name__)


class ExpertParallelExperts(nn.Module):
    """This rank's share of a converted HF experts module, with the all-to-all exchange around it.

    ``forward(hidden_states (T, hidden), top_k_index (T, k) int64, top_k_weights (T, k)) -> (T, hidden)``, as the
    module it replaces. ``local`` is the experts module of this rank (``local.num_experts`` experts; its
    parameter ``P`` holds rows ``[expert_offset, expert_offset + local_experts)`` of the full ``P``).

    Args:
        experts: a converted experts module (``splitgrad.convert``) holding all ``num_experts`` experts; it is not
            modified (its parameters are sliced, not moved).
        ep_group: the expert-parallel group; its size must divide ``num_experts``.

    Raises:
        ValueError: ``experts`` is not a converted experts module, or the group's size does not divide its
            ``num_experts``.
    """

    def __init__(self, experts: nn.Module, ep_group: dist.ProcessGroup) -> None:
        super().__init__()
        if not isinstance(experts, SplitExperts):
            raise ValueError(
                f"ExpertParallelExperts: {type(experts).__name__} is not a converted experts module; call "
                "splitgrad.convert(model) before shard_hf_experts"
            )
        self.num_experts = experts.num_experts
        self.dispatcher = AllToAllDispatcher(ep_group, self.num_experts, owner="ExpertParallelExperts")
        """The all-to-all token exchange over ``ep_group`` (not a submodule: it holds no parameters)."""
        rows = slice(self.expert_offset, self.expert_offset + self.local_experts)
        # deepcopy with the memo pre-filled: the copy gets this rank's rows in place of each full parameter,
        # and the full tensors are never copied.
        memo = {
            id(p): nn.Parameter(p.detach()[rows].clone(), requires_grad=p.requires_grad)
            for p in experts.parameters(recurse=False)
        }
        self.local = copy.deepcopy(experts, memo)
        self.local.num_experts = self.local_experts
        for p in self.local.parameters():
            p.expert_parallel = True
        #: Run the local experts' deferred W inside the backward's dispatch all-to-all (while it is in flight)
        #: instead of at ``backward_dw`` (see :mod:`splitgrad.parallel.expert.dispatch_wgrad`).
        self.wgrad_in_dispatch = False

    @property
    def local_experts(self) -> int:
        """Experts held on this rank (``num_experts / ep_size``)."""
        return self.dispatcher.local_experts

    @property
    def expert_offset(self) -> int:
        """Global index of this rank's first expert."""
        return self.dispatcher.expert_offset

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        counts = torch.bincount(top_k_index.reshape(-1), minlength=self.num_experts)
        if counts.numel() != self.num_experts:
            raise ValueError(
                f"ExpertParallelExperts: expert ids must be < num_experts={self.num_experts}, got "
                f"{int(top_k_index.max())} (transformers' expert-parallel sentinels are not used here)"
            )
        exchange = self.dispatcher.start_counts(counts)
        sent, order = permute_tokens(hidden_states, top_k_index)
        rows, m_splits, plan = run_steps(
            self.dispatcher.dispatch(sent, counts, exchange, in_backward_flight=self._in_dispatch_backward)
        )
        local_ids = torch.arange(self.local_experts, device=rows.device)
        ids = torch.repeat_interleave(local_ids, torch.tensor(m_splits, device=rows.device)).unsqueeze(1)
        # Weight 1 here (exact), the routing weights once, when the k copies are summed.
        y = self.local(rows, ids, torch.ones(ids.shape, dtype=top_k_weights.dtype, device=rows.device))
        y = run_steps(self.dispatcher.combine(y, plan))
        return unpermute_tokens(y, order, top_k_weights).to(hidden_states.dtype)

    def _in_dispatch_backward(self) -> None:
        if self.wgrad_in_dispatch:
            run_expert_wgrad([self.local])

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, local_experts={self.local_experts}, "
            f"expert_offset={self.expert_offset}"
        )


def shard_hf_experts(model: nn.Module, ep_group: dist.ProcessGroup) -> list[str]:
    """Replace every converted experts module of ``model`` by an :class:`ExpertParallelExperts` over ``ep_group``.

    Every rank of ``ep_group`` calls it on the same (same-weights) converted model; each keeps its own experts.
    The parameter ``...experts.P`` of the model becomes ``...experts.local.P`` (this rank's rows).

    Args:
        model: a transformers v5 MoE model after ``splitgrad.convert(model)``.
        ep_group: the expert-parallel group.

    Returns:
        The qualified names of the replaced modules.

    Raises:
        ValueError: no converted experts module in ``model`` (``splitgrad.convert`` not called, or no MoE), or
            ``ep_group``'s size does not divide a module's ``num_experts``.
    """
    targets = [(name, m) for name, m in model.named_modules() if isinstance(m, SplitExperts)]
    if not targets:
        raise ValueError(
            f"shard_hf_experts: {type(model).__name__} has no converted experts module; call "
            "splitgrad.convert(model) first"
        )
    if targets[0][0] == "":
        raise ValueError("shard_hf_experts: pass the model holding the experts module, not the module itself")
    for name, experts in targets:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, attr, ExpertParallelExperts(experts, ep_group))
    logger.info(
        "shard_hf_experts: %d experts modules over %d ranks", len(targets), dist.get_world_size(ep_group)
    )
    return [name for name, _ in targets]
