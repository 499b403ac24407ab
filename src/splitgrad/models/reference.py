"""Plain-autograd twins of :class:`~splitgrad.models.GPT` and :class:`~splitgrad.models.MoEGPT`.

:func:`reference_twin` copies a model's parameters, under the *same qualified names*, into a
:class:`ReferenceModel` whose forward is written from scratch with elementary torch ops: explicit norms,
``softmax(q k^T / sqrt(d) + causal mask) v`` instead of SDPA, ``x @ W.T + b`` instead of splitgrad layers, and,
for MoE, a loop over experts with boolean masks instead of the sort-based permutation and ``GroupedLinear``.
Nothing in it splits a backward, so its gradients are what plain autograd says the model's should be; tests
compare the two name by name in float64.

The twin has no dropout (it raises if asked to train with ``config.dropout > 0``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from .config import GPTConfig, MoEConfig
from .gpt import GPT

__all__ = ["ReferenceModel", "reference_twin"]

logger = logging.getLogger(__name__)

Params = Mapping[str, torch.Tensor]


def _norm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, config: GPTConfig
) -> torch.Tensor:
    gamma = weight + 1 if config.zero_centered_gamma else weight
    if config.normalization == "LayerNorm":
        mu = x.mean(-1, keepdim=True)
        var = (x - mu).pow(2).mean(-1, keepdim=True)
        y = (x - mu) / torch.sqrt(var + config.layernorm_epsilon) * gamma
        return y if bias is None else y + bias
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + config.layernorm_epsilon) * gamma


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    y = x @ weight.t()
    return y if bias is None else y + bias


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x.pow(3))))


def _activation(h: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "gelu":
        return _gelu_tanh(h)
    if activation == "relu":
        return h.clamp(min=0)
    a, b = h.chunk(2, dim=-1)
    return (a * torch.sigmoid(a) if activation == "swiglu" else _gelu_tanh(a)) * b


def _attention(x: torch.Tensor, p: Params, pre: str, config: GPTConfig) -> torch.Tensor:
    b, s, h = x.shape
    nh, hd = config.num_heads, config.head_dim
    ln = _norm(x, p[pre + "qkv.layer_norm_weight"], p.get(pre + "qkv.layer_norm_bias"), config)
    qkv = _linear(ln, p[pre + "qkv.weight"], p.get(pre + "qkv.bias"))
    q, k, v = (t.reshape(b, s, nh, hd).transpose(1, 2) for t in qkv.split(h, dim=-1))
    scores = q @ k.transpose(-1, -2) / math.sqrt(hd)
    future = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
    y = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1) @ v
    return _linear(y.transpose(1, 2).reshape(b, s, h), p[pre + "proj.weight"], p.get(pre + "proj.bias"))


def _mlp(x: torch.Tensor, p: Params, pre: str, config: GPTConfig) -> torch.Tensor:
    ln = _norm(x, p[pre + "layer_norm_weight"], p.get(pre + "layer_norm_bias"), config)
    hid = _activation(_linear(ln, p[pre + "fc1_weight"], p.get(pre + "fc1_bias")), config.activation)
    return _linear(hid, p[pre + "fc2_weight"], p.get(pre + "fc2_bias"))


def _expert(p: Params, pre: str, e: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Expert ``e``'s ``(weight, bias)`` of a grouped linear, either layout (``weight{e}`` or ``weight[e]``)."""
    if pre + "weight" in p:
        bias = p.get(pre + "bias")
        return p[pre + "weight"][e], (bias[e] if bias is not None else None)
    return p[f"{pre}weight{e}"], p.get(f"{pre}bias{e}")


def _moe(x: torch.Tensor, p: Params, pre: str, config: MoEConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-expert loop over boolean masks; returns ``(out, aux_loss)`` with the coefficient applied."""
    shape = x.shape
    h = _norm(x.reshape(-1, shape[-1]), p[pre + "norm.weight"], p.get(pre + "norm.bias"), config)
    logits = _linear(h, p[pre + "router.weight"], None)
    probs = torch.softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
    if config.router_force_load_balancing:
        # Its own spelling of the round-robin rule: token t's copy j to expert (t * top_k + j) mod E.
        tokens, k = h.shape[0], config.top_k
        experts = torch.tensor([[(t * k + j) % config.num_experts for j in range(k)] for t in range(tokens)])
        weights = torch.stack([probs[t, experts[t]] for t in range(tokens)])
    else:
        weights, experts = probs.topk(config.top_k, dim=-1)
    if config.norm_topk_prob:
        weights = weights / weights.sum(-1, keepdim=True)
    weights = weights.to(h.dtype)
    out = torch.zeros_like(h)
    for e in range(config.num_experts):
        tok, slot = (experts == e).nonzero(as_tuple=True)
        fc1 = _linear(h[tok], *_expert(p, f"{pre}fc1.", e))
        y = _linear(_activation(fc1, config.activation), *_expert(p, f"{pre}fc2.", e))
        out = out.index_add(0, tok, y * weights[tok, slot].unsqueeze(-1))
    fraction = torch.stack([(experts == e).sum() for e in range(config.num_experts)]).to(probs.dtype)
    fraction = fraction / (h.shape[0] * config.top_k)
    aux = config.aux_loss_coef * config.num_experts * (fraction * probs.mean(0)).sum()
    return out.reshape(shape), aux


def reference_forward(config: GPTConfig, p: Params, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's function on a name -> tensor mapping (the names of ``GPT.named_parameters()``).

    Args:
        config: the model's config (an :class:`MoEConfig` selects the MoE branch).
        p: parameters by qualified name.
        ids: ``(batch, seq)`` int64.

    Returns:
        ``(logits, aux_loss)``: ``logits: (batch, seq, vocab)`` and the summed, coefficient-weighted
        load-balancing losses (a zero scalar for a dense GPT).
    """
    wte = p["embed.wte.weight"]
    x = wte[ids] + p["embed.wpe.weight"][: ids.shape[1]]
    aux = x.new_zeros(())
    for i in range(config.num_layers):
        pre = f"blocks.{i}."
        x = x + _attention(x, p, pre + "attn.", config)
        if isinstance(config, MoEConfig):
            out, layer_aux = _moe(x, p, pre + "mlp.", config)
            aux = aux + layer_aux
        else:
            out = _mlp(x, p, pre + "mlp.", config)
        x = x + out
    x = _norm(x, p["head.norm.weight"], p.get("head.norm.bias"), config)
    head = wte if config.tie_embeddings else p["head.proj.weight"]
    return _linear(x, head, None), aux


class ReferenceModel(nn.Module):
    """Plain-torch twin holding copies of a model's parameters under the same qualified names.

    ``forward(ids) -> (logits, aux_loss)``; :meth:`loss` is the full objective ``CE + aux_scale * aux``.
    """

    def __init__(self, config: GPTConfig, named_parameters: Mapping[str, torch.Tensor]) -> None:
        super().__init__()
        self.config = config
        for name, value in named_parameters.items():
            *path, leaf = name.split(".")
            owner: nn.Module = self
            for part in path:
                child = owner._modules.get(part)
                if child is None:
                    child = nn.Module()
                    owner.add_module(part, child)
                owner = child
            owner.register_parameter(
                leaf, nn.Parameter(value.detach().clone(), requires_grad=value.requires_grad)
            )

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.training and self.config.dropout > 0:
            raise RuntimeError(
                f"ReferenceModel has no dropout; compare with dropout=0 or in eval mode ({self.config.dropout=})"
            )
        return reference_forward(self.config, dict(self.named_parameters()), ids)

    def loss(self, ids: torch.Tensor, targets: torch.Tensor, *, aux_scale: float = 1.0) -> torch.Tensor:
        """``cross_entropy(logits, targets) + aux_scale * aux_loss`` (``aux_scale`` as in ``set_aux_loss_scale``)."""
        logits, aux = self(ids)
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        return ce + aux_scale * aux


def reference_twin(model: GPT) -> ReferenceModel:
    """A :class:`ReferenceModel` with copies of ``model``'s current parameter values (same names, dtypes)."""
    if not isinstance(model, GPT):
        raise TypeError(
            f"reference_twin expects a splitgrad.models.GPT or MoEGPT, got {type(model).__name__}"
        )
    return ReferenceModel(model.config, dict(model.named_parameters()))
