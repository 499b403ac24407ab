"""Fused ops and the fusion functions that create them (one per file)."""

from __future__ import annotations

from .backward_activation_bias import BackwardActivationBias, fuse_backward_activation_bias
from .forward_linear_bias_activation import ForwardLinearBiasActivation, fuse_forward_linear_bias_activation

__all__ = [
    "BackwardActivationBias",
    "ForwardLinearBiasActivation",
    "fuse_backward_activation_bias",
    "fuse_forward_linear_bias_activation",
]
