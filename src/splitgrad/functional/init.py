"""Parameter initialisation shared by ``splitgrad.module`` and ``splitgrad.ops`` (``torch.nn.Linear``'s)."""

from __future__ import annotations

import math

from torch import nn

__all__ = ["linear_init_"]


def linear_init_(weight: nn.Parameter, bias: nn.Parameter | None = None) -> None:
    """``torch.nn.Linear``'s initialisation of ``weight: (out, in)`` and ``bias: (out,)``.

    Same calls in the same order as ``nn.Linear.reset_parameters``, so seeded layers match it exactly.
    """
    nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
    if bias is not None:
        fan_in = weight.shape[1]
        bound = 1 / math.sqrt(fan_in) if fan_in > 0 else 0
        nn.init.uniform_(bias, -bound, bound)
