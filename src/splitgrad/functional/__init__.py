"""Torch-only kernels shared by ``splitgrad.module`` and ``splitgrad.ops``: wgrad writers, init, norms, activations."""

from __future__ import annotations
