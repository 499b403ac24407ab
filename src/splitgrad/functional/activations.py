"""MLP activations with explicit backward: ``gelu`` (tanh, as TE), ``relu``, ``swiglu``, ``geglu``.

Each backward calls the same ATen backward kernel plain autograd would (``gelu_backward``,
``threshold_backward``, ``silu_backward``), so :class:`~splitgrad.LayerNormMLP` matches an ``nn.Module`` MLP
closely (bitwise for the element-wise parts). Gated activations read ``h = [a, b]`` (halves of the last
dimension): ``swiglu = silu(a) * b``, ``geglu = gelu_tanh(a) * b``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["ACTIVATIONS", "activation_backward", "activation_forward", "check_activation", "is_gated"]

ACTIVATIONS = ("gelu", "relu", "swiglu", "geglu")
_GATED = ("swiglu", "geglu")


def check_activation(owner: str, activation: str) -> None:
    """Raise ``ValueError`` unless ``activation`` is one of :data:`ACTIVATIONS`."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"{owner}: activation must be one of {ACTIVATIONS}, got {activation=}")


def is_gated(activation: str) -> bool:
    """Whether fc1 produces ``2 * ffn_hidden_size`` features (gate and value halves)."""
    return activation in _GATED


def activation_forward(h: torch.Tensor, activation: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Apply ``activation`` to ``h``.

    Args:
        h: ``(tokens, ffn)`` or, gated, ``(tokens, 2 * ffn)``.

    Returns:
        ``(out, extra)`` with ``out: (tokens, ffn)``; ``extra`` is the gated branch's ``act(a)`` (what plain
        autograd would save for the product), else None.
    """
    if activation == "gelu":
        return F.gelu(h, approximate="tanh"), None
    if activation == "relu":
        return F.relu(h), None
    a, b = h.chunk(2, dim=-1)
    act_a = F.silu(a) if activation == "swiglu" else F.gelu(a, approximate="tanh")
    return act_a * b, act_a


def activation_backward(
    dout: torch.Tensor, h: torch.Tensor, out: torch.Tensor, extra: torch.Tensor | None, activation: str
) -> torch.Tensor:
    """Gradient w.r.t. ``h`` of :func:`activation_forward` for ``dout: (tokens, ffn)``; same shape as ``h``."""
    if activation == "gelu":
        return torch.ops.aten.gelu_backward(dout, h, approximate="tanh")
    if activation == "relu":
        return torch.ops.aten.threshold_backward(dout, out, 0)
    a, b = h.chunk(2, dim=-1)
    d_act_a = dout * b
    if activation == "swiglu":
        da = torch.ops.aten.silu_backward(d_act_a, a)
    else:
        da = torch.ops.aten.gelu_backward(d_act_a, a, approximate="tanh")
    return torch.cat([da, dout * extra], dim=-1)
