"""Test helpers shared by splitgrad's suites: a multi-rank spawn harness and float64 references."""

from __future__ import annotations

from .memory import AllocationTracker
from .reference import assert_grads_close, main_grads, make_plain, plain_autograd_grads, shard
from .spawn import RankFailure, SpawnError, SpawnTimeoutError, spawn

__all__ = [
    "AllocationTracker",
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
