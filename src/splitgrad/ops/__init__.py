"""Fusible operations (``splitgrad.ops``): compose layers from small ops that a fuser runs as one autograd Function.

TE's ``te.ops`` contract (``op_forward`` / ``op_backward`` returning gradients, fusions as registered
functions ``list[op] -> list[op]``, a drop-in ``Sequential``) with splitgrad's split backward on the linear ops:
``delay_wgrad_compute``, ``backward_dw``, ``register_wgrad_accumulation_and_reduce_hooks`` and
``get_backward_dw_params`` on ``BasicLinear``, ``GroupedLinear``, ``Linear`` and ``Sequential``.

The built-in fused ops and fusion functions are in :mod:`splitgrad.ops.fused` (``ops.default_fusions()`` is
the registry of them). A fusion function is any ``list[op] -> list[op]`` registered in a
:class:`FusionRegistry`; the fuser that runs a group of ops as one autograd Function
(:class:`splitgrad.ops.fuser.OperationFuser`) is an internal of :class:`Sequential`.
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
from .fused import default_fusions
from .fuser import FusionRegistry
from .linear import Linear
from .op import BasicOperation, FusedOperation, FusibleOperation, OperationContext
from .sequential import Sequential, WgradHookHandles

__all__ = [
    "GEGLU",
    "GELU",
    "Activation",
    "BasicLinear",
    "BasicOperation",
    "Bias",
    "FusedOperation",
    "FusibleOperation",
    "FusionRegistry",
    "GroupedLinear",
    "LayerNorm",
    "Linear",
    "OperationContext",
    "RMSNorm",
    "ReLU",
    "Sequential",
    "SiLU",
    "SwiGLU",
    "WgradHookHandles",
    "default_fusions",
]
