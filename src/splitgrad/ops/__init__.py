"""Fusible operations (``splitgrad.ops``): compose layers from small ops that a fuser runs as one autograd Function.

TE's ``te.ops`` contract (``op_forward`` / ``op_backward`` returning gradients, fusions as registered
functions ``list[op] -> list[op]``, a drop-in ``Sequential``) with splitgrad's split backward on the linear ops:
``delay_wgrad_compute``, ``backward_dw``, ``register_wgrad_accumulation_and_reduce_hooks`` and
``get_backward_dw_params`` on ``BasicLinear``, ``GroupedLinear``, ``Linear`` and ``Sequential``.
"""

from __future__ import annotations

from .basic import (
    GEGLU,
    GELU,
    Activation,
    BasicLinear,
    Bias,
    GroupedLinear,
    LayerNorm,
    ReLU,
    RMSNorm,
    SiLU,
    SwiGLU,
)
from .fused import (
    BackwardActivationBias,
    ForwardLinearBiasActivation,
    default_fusions,
    fuse_backward_activation_bias,
    fuse_forward_linear_bias_activation,
)
from .fuser import FusionFn, FusionRegistry, OperationFuser
from .linear import Linear
from .op import BasicOperation, FusedOperation, FusibleOperation, OperationContext
from .sequential import Sequential, WgradHookHandles

__all__ = [
    "GEGLU",
    "GELU",
    "Activation",
    "BackwardActivationBias",
    "BasicLinear",
    "BasicOperation",
    "Bias",
    "ForwardLinearBiasActivation",
    "FusedOperation",
    "FusibleOperation",
    "FusionFn",
    "FusionRegistry",
    "GroupedLinear",
    "LayerNorm",
    "Linear",
    "OperationContext",
    "OperationFuser",
    "RMSNorm",
    "ReLU",
    "Sequential",
    "SiLU",
    "SwiGLU",
    "WgradHookHandles",
    "default_fusions",
    "fuse_backward_activation_bias",
    "fuse_forward_linear_bias_activation",
]
