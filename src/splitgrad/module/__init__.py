"""User-facing ``nn.Module``s with a splittable backward (one per file).

Each runs its own autograd Function (private: ``_LinearFunction`` and so on); the contract they share is
:class:`splitgrad.core.SplitModule`.
"""

from __future__ import annotations

from .grouped_linear import GroupedLinear
from .layernorm_linear import LayerNormLinear
from .layernorm_mlp import LayerNormMLP
from .linear import Linear

__all__ = ["GroupedLinear", "LayerNormLinear", "LayerNormMLP", "Linear"]
