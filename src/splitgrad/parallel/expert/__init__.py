"""Expert parallelism: MoE experts sharded over a process group, tokens exchanged with all-to-all."""

from __future__ import annotations

from .all_to_all import AllToAll, all_to_all, exchange_counts
from .layer import EXPERT_KINDS, ExpertParallelMoEMLP
from .state import load_full_state_dict

__all__ = [
    "EXPERT_KINDS",
    "AllToAll",
    "ExpertParallelMoEMLP",
    "all_to_all",
    "exchange_counts",
    "load_full_state_dict",
]
