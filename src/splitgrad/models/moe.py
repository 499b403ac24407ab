"""Mixture-of-experts GPT: a top-k softmax router and experts as pairs of :class:`~splitgrad.GroupedLinear`.

One MoE layer, on the flattened tokens ``x: (T, hidden)``::

    h = norm(x)
    probs, w, e = router.route(h)                     # (T, E) softmax; (T, k) weights and expert ids
    rows, order = permute_tokens(h, e)                # token copies grouped by expert: no per-token Python
    y = fc2(act(fc1(rows, m_splits)), m_splits)       # m_splits = tokens per expert (one host sync)
    out = unpermute_tokens(y, order, w)               # back in token order, the k copies weighted and summed

It is dropless (every token reaches its k experts; no capacity factor). The load-balancing loss of each layer,
``aux_loss_coef * E * sum_i f_i * P_i`` (Switch/GShard: ``f_i`` the fraction of routed copies sent to expert
``i``, ``P_i`` its mean router probability), is never returned: :class:`AuxLossInjector` attaches it to the
layer's output so that its gradient is added when backward reaches the layer. A pipeline stage therefore sends
only its activation; the last stage's loss is plain :func:`~splitgrad.models.lm_loss`.

The pieces (:class:`~splitgrad.models.router.TopKRouter`, :mod:`~splitgrad.models.experts`) are shared with the
expert-parallel layer, which puts an all-to-all dispatcher between the permutation and the experts.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

from .config import MoEConfig
from .experts import make_experts, permute_tokens, run_experts, unpermute_tokens
from .gpt import GPT, Norm
from .router import TopKRouter

__all__ = [
    "AuxLossInjector",
    "MoEGPT",
    "MoEMLP",
    "attach_aux_loss",
    "is_moe_layer",
    "moe_aux_loss",
    "moe_layers",
    "set_aux_loss_scale",
]

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


def attach_aux_loss(out: torch.Tensor, aux: torch.Tensor, *, scale: float, coef: float) -> torch.Tensor:
    """``out`` carrying the aux loss ``aux`` (a scalar) into backward with weight ``scale``
    (:class:`AuxLossInjector`); ``out`` itself when no gradient is wanted (no grad mode, ``coef == 0``)."""
    if torch.is_grad_enabled() and aux.requires_grad and coef > 0:
        return AuxLossInjector.apply(out, aux, scale)
    return out


class MoEMLP(nn.Module):
    """The MoE branch of a block: ``(batch, seq, hidden)`` -> ``(batch, seq, hidden)`` (residual not added).

    Submodules: ``norm`` (plain :class:`~splitgrad.models.gpt.Norm`), ``router``
    (:class:`~splitgrad.models.router.TopKRouter`, a splitgrad ``Linear`` ``hidden -> num_experts``, no bias),
    ``fc1`` / ``fc2`` (``GroupedLinear`` with one GEMM per expert, :func:`~splitgrad.models.experts.make_experts`).

    After each forward, ``last_aux_loss`` (detached, coefficient applied) and ``last_tokens_per_expert``
    hold that forward's statistics for logging. ``aux_loss_scale`` is the gradient weight of the aux loss
    (:func:`set_aux_loss_scale`).
    """

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.num_experts = config.num_experts
        self.activation = config.activation
        self.aux_loss_scale = 1.0
        self.last_aux_loss: torch.Tensor | None = None
        self.last_tokens_per_expert: list[int] | None = None
        self.norm = Norm(config)
        self.router = TopKRouter(config)
        self.fc1, self.fc2 = make_experts(config, config.num_experts)

    def residual_output_weights(self) -> list[nn.Parameter]:
        """fc2's weights (they write into the residual stream): one per expert, or the one grouped weight."""
        return list(self.fc2.grouped_params().weights)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        h = self.norm(x.reshape(-1, shape[-1]))
        probs, weights, experts = self.router.route(h)
        counts = torch.bincount(experts.reshape(-1), minlength=self.num_experts)
        # GroupedLinear needs the split sizes on the host: the one device sync of the layer.
        m_splits = counts.tolist()
        rows, order = permute_tokens(h, experts)
        y = run_experts(self.fc1, self.fc2, rows, m_splits, self.activation)
        out = unpermute_tokens(y, order, weights)

        aux = self.router.aux_loss(probs, counts)
        self.last_aux_loss = aux.detach()
        self.last_tokens_per_expert = m_splits
        out = attach_aux_loss(out, aux, scale=self.aux_loss_scale, coef=self.router.aux_loss_coef)
        return out.view(shape)


class MoEGPT(GPT):
    """The GPT of :class:`~splitgrad.models.GPT` with every MLP replaced by an :class:`MoEMLP`.

    ``forward(ids)`` returns logits exactly like :class:`GPT`; train with ``lm_loss(logits, targets)``: the
    load-balancing losses are added to the gradient automatically (:class:`AuxLossInjector`). For the value
    of the total objective, add :func:`moe_aux_loss` to the cross-entropy.

    This is the single-process model (the reference); its expert-parallel twin, with the experts sharded over a
    process group, is :class:`splitgrad.parallel.expert.ExpertParallelMoEGPT` (it passes its own ``make_mlp``).

    Args:
        config: the MoE model configuration.
        device: where to create the parameters.
        make_mlp: ``make_mlp(config, layer)`` builds block ``layer``'s MoE branch; None: :class:`MoEMLP`.

    Raises:
        TypeError: ``config`` is not an :class:`MoEConfig`.
    """

    config: MoEConfig

    def __init__(
        self,
        config: MoEConfig,
        *,
        device: torch.device | str | None = None,
        make_mlp: Callable[[MoEConfig, int], nn.Module] | None = None,
    ) -> None:
        if not isinstance(config, MoEConfig):
            raise TypeError(f"MoEGPT needs an MoEConfig, got {type(config).__name__}")
        super().__init__(config, device=device, make_mlp=_moe_mlp if make_mlp is None else make_mlp)


def _moe_mlp(config: MoEConfig, layer: int) -> MoEMLP:
    del layer
    return MoEMLP(config)


def is_moe_layer(module: nn.Module) -> bool:
    """Whether ``module`` is an MoE layer of these models: one routing with a
    :class:`~splitgrad.models.router.TopKRouter` (:class:`MoEMLP`, or its expert-parallel twin
    :class:`splitgrad.parallel.expert.ExpertParallelMoEMLP`, which composes the same router)."""
    return isinstance(getattr(module, "router", None), TopKRouter)


def moe_layers(model: nn.Module) -> list[nn.Module]:
    """Every MoE layer (:func:`is_moe_layer`) in ``model`` (a model or a pipeline stage), in registration order."""
    return [m for m in model.modules() if is_moe_layer(m)]


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
