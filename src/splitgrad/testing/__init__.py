"""Test helpers shared by splitgrad's suites: float64 references, an allocation tracker, the CPU graph emulator
(a test double for CUDA graphs), and the local process launcher (``spawn``, re-exported from
:mod:`splitgrad.distributed.launch`, where it lives because the demo CLI uses it too)."""

from __future__ import annotations

from ..distributed.launch import RankFailure, SpawnError, SpawnTimeoutError, spawn
from .graph_emulator import CpuGraph, CpuGraphBackend
from .memory import AllocationTracker
from .reference import assert_grads_close, main_grads, make_plain, plain_autograd_grads, shard

__all__ = [
    "AllocationTracker",
    "CpuGraph",
    "CpuGraphBackend",
    "RankFailure",
    "SpawnError",
    "SpawnTimeoutError",
    "assert_grads_close",
    "main_grads",
    "make_plain",
    "plain_autograd_grads",
    "shard",
    "spawn",
]
