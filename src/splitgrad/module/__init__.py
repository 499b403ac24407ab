"""User-facing ``nn.Module``s with a splittable backward (one per file)."""

from __future__ import annotations

from ._base import SplitModule
from .linear import Linear, LinearFunction

__all__ = ["Linear", "LinearFunction", "SplitModule"]
