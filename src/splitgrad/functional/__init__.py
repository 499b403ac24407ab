"""Pure torch kernels shared by ``splitgrad.module`` and ``splitgrad.ops``: wgrad writers, init, norms,
activations, split sizes. No process groups here: those are :mod:`splitgrad.distributed`'s."""

from __future__ import annotations
