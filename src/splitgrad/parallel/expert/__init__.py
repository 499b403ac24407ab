"""Expert parallelism: MoE experts sharded over a process group, tokens exchanged with all-to-all."""

from __future__ import annotations

from .all_to_all import (
    AllToAll,
    CountExchange,
    PendingExchange,
    all_to_all,
    exchange_counts,
    finish_all_to_all,
    start_all_to_all,
    start_count_exchange,
)
from .dispatch_wgrad import run_expert_wgrad
from .grad_sync import ExpertDataParallel, ParameterGroup, is_expert_parameter
from .layer import EXPERT_KINDS, ExpertParallelMoEMLP
from .model import ExpertParallelMoEGPT
from .overlap import DRIVERS, OverlappedMoEStage, overlapped_forward_backward, set_wgrad_in_dispatch
from .state import load_full_state_dict

__all__ = [
    "DRIVERS",
    "EXPERT_KINDS",
    "AllToAll",
    "CountExchange",
    "ExpertDataParallel",
    "ExpertParallelMoEGPT",
    "ExpertParallelMoEMLP",
    "OverlappedMoEStage",
    "ParameterGroup",
    "PendingExchange",
    "all_to_all",
    "exchange_counts",
    "finish_all_to_all",
    "is_expert_parameter",
    "load_full_state_dict",
    "overlapped_forward_backward",
    "run_expert_wgrad",
    "set_wgrad_in_dispatch",
    "start_all_to_all",
    "start_count_exchange",
]
