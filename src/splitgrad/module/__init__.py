"""User-facing ``nn.Module``s with a splittable backward (one per file)."""

from __future__ import annotations

from ..core import SplitModule
from .grouped_linear import GroupedLinear, GroupedLinearFunction
from .layernorm_linear import LayerNormLinear, LayerNormLinearFunction
from .layernorm_mlp import LayerNormMLP, LayerNormMLPFunction
from .linear import Linear, LinearFunction

__all__ = [
    "GroupedLinear",
    "GroupedLinearFunction",
    "LayerNormLinear",
    "LayerNormLinearFunction",
    "LayerNormMLP",
    "LayerNormMLPFunction",
    "Linear",
    "LinearFunction",
    "SplitModule",
]
