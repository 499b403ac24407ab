"""Fused ops, the fusion functions that create them (one per file), and the built-in registry."""

from __future__ import annotations

from ..fuser import FusionRegistry
from .backward_activation_bias import BackwardActivationBias, fuse_backward_activation_bias
from .forward_linear_bias_activation import ForwardLinearBiasActivation, fuse_forward_linear_bias_activation

__all__ = [
    "BackwardActivationBias",
    "ForwardLinearBiasActivation",
    "default_fusions",
    "fuse_backward_activation_bias",
    "fuse_forward_linear_bias_activation",
]


def default_fusions() -> FusionRegistry:
    """A fresh registry with the built-in fusions (Linear+Bias[+activation] forward, activation+bias backward)."""
    return FusionRegistry(
        forward=[fuse_forward_linear_bias_activation], backward=[fuse_backward_activation_bias]
    )
