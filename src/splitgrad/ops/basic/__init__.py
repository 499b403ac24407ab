"""Basic ops: the units users compose (one op per file; the activation family shares one)."""

from __future__ import annotations

from .activation import GEGLU, GELU, Activation, ReLU, SiLU, SwiGLU
from .basic_linear import BasicLinear
from .bias import Bias
from .grouped_linear import GroupedLinear
from .layer_norm import LayerNorm
from .rms_norm import RMSNorm

__all__ = [
    "GEGLU",
    "GELU",
    "Activation",
    "BasicLinear",
    "Bias",
    "GroupedLinear",
    "LayerNorm",
    "RMSNorm",
    "ReLU",
    "SiLU",
    "SwiGLU",
]
