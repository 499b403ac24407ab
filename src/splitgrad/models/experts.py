"""The experts of an MoE layer and the token permutation around them, shared by the single-process
:class:`~splitgrad.models.MoEMLP` and the expert-parallel layer (:mod:`splitgrad.parallel.expert`).

The experts are two grouped GEMMs (``fc1``, ``fc2``: :class:`splitgrad.GroupedLinear` modules, or
:class:`splitgrad.ops.GroupedLinear` ops), registered on the layer itself so that its state dict keeps
``fc1.weight{i}`` / ``fc2.weight{i}`` (one weight per expert) or, with ``moe_single_grouped_weight``,
``fc1.weight`` / ``fc2.weight`` (one ``(experts, out, in)`` tensor, TE's ``single_grouped_weight``). The permutation sorts the ``T * k`` token copies by expert (stable,
so each expert sees its tokens in order) and undoes it after the experts, weighting and summing the ``k``
copies.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..module.grouped_linear import GroupedLinear
from ..ops.basic.grouped_linear import GroupedLinear as GroupedLinearOp
from .config import MoEConfig
from .gpt import split_kwargs

__all__ = [
    "EXPERT_KINDS",
    "inverse_permutation",
    "make_experts",
    "moe_activation",
    "permute_tokens",
    "run_experts",
    "unpermute_tokens",
]

#: ``"module"``: experts are :class:`splitgrad.GroupedLinear` modules; ``"ops"``: :class:`splitgrad.ops.GroupedLinear`.
EXPERT_KINDS = ("module", "ops")


def make_experts(config: MoEConfig, num_experts: int, kind: str = "module") -> tuple[nn.Module, nn.Module]:
    """``(fc1, fc2)`` for ``num_experts`` experts: ``hidden -> ffn`` (``2 * ffn`` gated) and ``ffn -> hidden``.

    Args:
        config: the model config (``moe_ffn_hidden_size``, ``activation``, ``bias``, split keywords).
        num_experts: experts held here (all of them, or one rank's share under expert parallelism).
        kind: one of :data:`EXPERT_KINDS`.

    Raises:
        ValueError: an unknown ``kind``.
    """
    if kind not in EXPERT_KINDS:
        raise ValueError(f"make_experts: kind must be one of {EXPERT_KINDS}, got {kind=}")
    h, f = config.hidden_size, config.moe_ffn_hidden_size
    width = 2 * f if config.activation in ("swiglu", "geglu") else f
    single = config.moe_single_grouped_weight
    layout = {"single_grouped_weight": single, "single_grouped_bias": single}
    if kind == "module":
        return (
            GroupedLinear(num_experts, h, width, config.bias, **split_kwargs(config), **layout),
            GroupedLinear(num_experts, f, h, config.bias, **split_kwargs(config), **layout),
        )
    kw = {
        **layout,
        "bias": config.bias,
        "delay_wgrad_compute": config.delay_wgrad_compute,
        "accumulate_into_main_grad": config.fuse_wgrad_accumulation,
        "dtype": config.params_dtype,
    }
    return GroupedLinearOp(num_experts, h, width, **kw), GroupedLinearOp(num_experts, f, h, **kw)


def moe_activation(h: torch.Tensor, activation: str) -> torch.Tensor:
    """``h: (T, ffn)`` or, gated, ``(T, 2 * ffn)`` -> ``(T, ffn)`` (same rules as LayerNormMLP)."""
    if activation == "gelu":
        return F.gelu(h, approximate="tanh")
    if activation == "relu":
        return F.relu(h)
    a, b = h.chunk(2, dim=-1)
    return (F.silu(a) if activation == "swiglu" else F.gelu(a, approximate="tanh")) * b


def run_experts(
    fc1: nn.Module, fc2: nn.Module, rows: torch.Tensor, m_splits: list[int], activation: str
) -> torch.Tensor:
    """``fc2(act(fc1(rows)))`` per expert: ``rows: (sum(m_splits), hidden)`` grouped by expert, ``m_splits[i]``
    rows for expert ``i`` -> ``(sum(m_splits), hidden)``."""
    return fc2(moe_activation(fc1(rows, m_splits), activation), m_splits)


def permute_tokens(h: torch.Tensor, experts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The token copies of ``h: (T, hidden)`` sorted by expert.

    Args:
        h: the tokens.
        experts: ``(T, k)`` int64, each token's experts.

    Returns:
        ``(rows, order)``: ``rows: (T * k, hidden)``, copy ``order[i]`` (``t * k + j``: copy ``j`` of token
        ``t``) at row ``i``; ``order: (T * k,)``, a stable sort of the experts.
    """
    tokens, k = experts.shape
    order = torch.argsort(experts.reshape(-1), stable=True)
    # Gather from k expanded copies rather than h[order // k]: every index is then unique, so the backward
    # scatter is deterministic on GPUs too (the sum over the k copies is the expand's own reduction).
    copies = h.unsqueeze(1).expand(tokens, k, h.shape[-1]).reshape(-1, h.shape[-1])
    return copies.index_select(0, order), order


def inverse_permutation(order: torch.Tensor) -> torch.Tensor:
    """``inverse`` with ``inverse[order[i]] = i``: where each original position went."""
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return inverse


def unpermute_tokens(y: torch.Tensor, order: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Undo :func:`permute_tokens` on the expert outputs ``y: (T * k, hidden)`` and combine each token's ``k``
    copies weighted by ``weights: (T, k)`` -> ``(T, hidden)``."""
    tokens, k = weights.shape
    # Copy j of token t sits at position inverse[t * k + j] of the sorted order.
    return (y.index_select(0, inverse_permutation(order)).view(tokens, k, -1) * weights.unsqueeze(-1)).sum(1)
