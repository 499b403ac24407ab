"""Mixture-of-experts GPT: a top-k softmax router and experts as pairs of :class:`~splitgrad.GroupedLinear`.

One MoE layer, on the flattened tokens ``x: (T, hidden)``::

    h = norm(x)
    probs = softmax(router(h))                        # (T, E); router is a bias-free splitgrad Linear
    w, e = topk(probs, k)                             # (T, k) weights and expert ids
    order = argsort(e.flatten(), stable)              # token copies grouped by expert: no per-token Python
    y = fc2(act(fc1(h[order // k], m_splits)), m_splits)   # m_splits = tokens per expert (one host sync)
    out = sum_k w * y[inverse(order)].view(T, k, hidden)

It is dropless (every token reaches its k experts; no capacity factor). The load-balancing loss of each layer,
``aux_loss_coef * E * sum_i f_i * P_i`` (Switch/GShard: ``f_i`` the fraction of routed copies sent to expert
``i``, ``P_i`` its mean router probability), is never returned: :class:`AuxLossInjector` attaches it to the
layer's output so that its gradient is added when backward reaches the layer. A pipeline stage therefore sends
only its activation; the last stage's loss is plain :func:`~splitgrad.models.lm_loss`.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from ..module.grouped_linear import GroupedLinear
from ..module.linear import Linear
from .config import MoEConfig
from .gpt import GPT, Norm, split_kwargs

__all__ = ["AuxLossInjector", "MoEGPT", "MoEMLP", "moe_aux_loss", "moe_layers", "set_aux_loss_scale"]

logger = logging.getLogger(__name__)


class AuxLossInjector(torch.autograd.Function):
    """Identity on ``output`` whose backward also seeds ``aux_loss`` with gradient ``scale``.

    Megatron's ``MoEAuxLossAutoScaler`` idea: ``total = main_loss + scale * aux_loss`` is differentiated
    without ever adding the two tensors, so the aux loss does not have to travel to the stage that computes
    the main loss. ``scale`` is the weight of one microbatch's loss in the step (1 for a single batch, ``1 /
    n_microbatches`` when the pipeline averages microbatch losses; see :func:`set_aux_loss_scale`).

    Shapes: ``output`` any, ``aux_loss`` a scalar; returns ``output`` unchanged.
    """

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux_loss: torch.Tensor, scale: float):  # type: ignore[override]
        ctx.save_for_backward(aux_loss)
        ctx.scale = scale
        return output

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):  # type: ignore[override]
        (aux_loss,) = ctx.saved_tensors
        return grad_output, torch.full_like(aux_loss, ctx.scale), None


def moe_activation(h: torch.Tensor, activation: str) -> torch.Tensor:
    """``h: (T, ffn)`` or, gated, ``(T, 2 * ffn)`` -> ``(T, ffn)`` (same rules as LayerNormMLP)."""
    if activation == "gelu":
        return F.gelu(h, approximate="tanh")
    if activation == "relu":
        return F.relu(h)
    a, b = h.chunk(2, dim=-1)
    return (F.silu(a) if activation == "swiglu" else F.gelu(a, approximate="tanh")) * b


def _balanced_experts(
    tokens: int, top_k: int, num_experts: int, device: torch.device | None = None
) -> torch.Tensor:
    """The forced-balance routing (``MoEConfig.router_force_load_balancing``): ``(tokens, top_k)`` int64, copy
    ``j`` of token ``t`` to expert ``(t * top_k + j) % num_experts`` (distinct per token since ``top_k <=
    num_experts``)."""
    slots = torch.arange(tokens * top_k, device=device).view(tokens, top_k)
    return slots % num_experts


class MoEMLP(nn.Module):
    """The MoE branch of a block: ``(batch, seq, hidden)`` -> ``(batch, seq, hidden)`` (residual not added).

    Submodules: ``norm`` (plain :class:`~splitgrad.models.gpt.Norm`), ``router`` (splitgrad ``Linear``,
    ``hidden -> num_experts``, no bias), ``fc1`` / ``fc2`` (``GroupedLinear`` with one GEMM per expert).

    After each forward, ``last_aux_loss`` (detached, coefficient applied) and ``last_tokens_per_expert``
    hold that forward's statistics for logging. ``aux_loss_scale`` is the gradient weight of the aux loss
    (:func:`set_aux_loss_scale`).
    """

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self._init_routing(config)
        h, f, e = config.hidden_size, config.moe_ffn_hidden_size, config.num_experts
        gated = config.activation in ("swiglu", "geglu")
        self.norm = Norm(config)
        self.router = Linear(h, e, False, **split_kwargs(config))
        self.fc1 = GroupedLinear(e, h, 2 * f if gated else f, config.bias, **split_kwargs(config))
        self.fc2 = GroupedLinear(e, f, h, config.bias, **split_kwargs(config))

    def _init_routing(self, config: MoEConfig) -> None:
        """The routing and aux-loss settings and statistics (shared with the expert-parallel layer)."""
        self.num_experts = config.num_experts
        self.top_k = config.top_k
        self.activation = config.activation
        self.norm_topk_prob = config.norm_topk_prob
        self.force_load_balancing = config.router_force_load_balancing
        self.aux_loss_coef = config.aux_loss_coef
        self.aux_loss_scale = 1.0
        self.last_aux_loss: torch.Tensor | None = None
        self.last_tokens_per_expert: list[int] | None = None

    def residual_output_weights(self) -> list[nn.Parameter]:
        """fc2's per-expert matrices (they write into the residual stream)."""
        return [getattr(self.fc2, f"weight{i}") for i in range(self.num_experts)]

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Router probabilities and the top-k choice of ``h: (T, hidden)``.

        Returns:
            ``(probs, weights, experts)``: ``probs: (T, E)`` softmax in at least fp32, ``weights: (T, k)`` in
            ``h``'s dtype, ``experts: (T, k)`` int64 (the round-robin choice of
            ``MoEConfig.router_force_load_balancing`` when it is set, the top-k of ``probs`` otherwise).
        """
        logits = self.router(h)
        probs = torch.softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
        if self.force_load_balancing:
            experts = _balanced_experts(h.shape[0], self.top_k, self.num_experts, h.device)
            weights = probs.gather(1, experts)
        else:
            weights, experts = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        return probs, weights.to(h.dtype), experts

    def aux_loss(self, probs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """``coef * E * sum_i f_i * P_i`` for ``probs: (T, E)`` and ``counts: (E,)`` routed copies per expert."""
        tokens = probs.shape[0]
        f = counts.to(probs.dtype) / (tokens * self.top_k)
        return self.aux_loss_coef * self.num_experts * (f * probs.mean(0)).sum()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        h = self.norm(x.reshape(-1, shape[-1]))
        tokens = h.shape[0]
        probs, weights, experts = self.route(h)

        # Permute: the T*k token copies sorted by expert (stable, so each expert sees tokens in order).
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts)
        # GroupedLinear needs the split sizes on the host: the one device sync of the layer.
        m_splits = counts.tolist()
        # Gather from k expanded copies rather than h[order // k]: every index is then unique, so the backward
        # scatter is deterministic on GPUs too (the sum over the k copies is the expand's own reduction).
        copies = h.unsqueeze(1).expand(tokens, self.top_k, h.shape[-1]).reshape(-1, h.shape[-1])
        y = self.fc1(copies.index_select(0, order), m_splits)
        y = self.fc2(moe_activation(y, self.activation), m_splits)

        # Unpermute: copy j of token t sits at position inverse[t * k + j] of the sorted order.
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        out = (y.index_select(0, inverse).view(tokens, self.top_k, -1) * weights.unsqueeze(-1)).sum(1)

        aux = self.aux_loss(probs, counts)
        self.last_aux_loss = aux.detach()
        self.last_tokens_per_expert = m_splits
        if torch.is_grad_enabled() and aux.requires_grad and self.aux_loss_coef > 0:
            out = AuxLossInjector.apply(out, aux, self.aux_loss_scale)
        return out.view(shape)


class MoEGPT(GPT):
    """The GPT of :class:`~splitgrad.models.GPT` with every MLP replaced by an :class:`MoEMLP`.

    ``forward(ids)`` returns logits exactly like :class:`GPT`; train with ``lm_loss(logits, targets)``: the
    load-balancing losses are added to the gradient automatically (:class:`AuxLossInjector`). For the value
    of the total objective, add :func:`moe_aux_loss` to the cross-entropy.

    This is the single-process model (the reference); its expert-parallel twin, with the experts sharded over a
    process group, is :class:`splitgrad.parallel.expert.ExpertParallelMoEGPT` (it overrides :meth:`_make_mlp`).
    """

    config: MoEConfig

    def __init__(self, config: MoEConfig, *, device: torch.device | str | None = None) -> None:
        if not isinstance(config, MoEConfig):
            raise TypeError(f"MoEGPT needs an MoEConfig, got {type(config).__name__}")
        super().__init__(config, device=device)

    def _make_mlp(self, config: MoEConfig, layer: int) -> nn.Module:  # type: ignore[override]
        del layer
        return MoEMLP(config)


def moe_layers(model: nn.Module) -> list[MoEMLP]:
    """Every :class:`MoEMLP` in ``model`` (a model or a pipeline stage), in registration order."""
    return [m for m in model.modules() if isinstance(m, MoEMLP)]


def moe_aux_loss(model: nn.Module) -> torch.Tensor | None:
    """Sum of the (detached, coefficient-weighted) aux losses of ``model``'s MoE layers' last forward."""
    losses = [m.last_aux_loss for m in moe_layers(model) if m.last_aux_loss is not None]
    return torch.stack(losses).sum() if losses else None


def set_aux_loss_scale(model: nn.Module, scale: float) -> int:
    """Set the gradient weight of the aux loss in every MoE layer of ``model``; returns how many were set.

    Use the weight the main loss of one microbatch has in the step: ``1 / n_microbatches`` when the
    microbatch losses are averaged, 1 when summed. Applies to forwards run after the call.
    """
    if not scale >= 0:
        raise ValueError(f"set_aux_loss_scale: scale must be >= 0, got {scale=}")
    layers = moe_layers(model)
    for layer in layers:
        layer.aux_loss_scale = float(scale)
    return len(layers)
