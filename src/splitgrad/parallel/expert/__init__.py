"""Expert parallelism: MoE experts sharded over a process group, tokens exchanged with all-to-all."""

from __future__ import annotations

from .grad_sync import ExpertDataParallel, ParameterGroup, is_expert_parameter
from .layer import ExpertParallelMoEMLP
from .model import ExpertParallelMoEGPT
from .overlap import OverlappedMoEStage, overlapped_forward_backward, set_wgrad_in_dispatch
from .state import load_full_state_dict

__all__ = [
    "ExpertDataParallel",
    "ExpertParallelMoEGPT",
    "ExpertParallelMoEMLP",
    "OverlappedMoEStage",
    "ParameterGroup",
    "is_expert_parameter",
    "load_full_state_dict",
    "overlapped_forward_backward",
    "set_wgrad_in_dispatch",
]
