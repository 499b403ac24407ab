"""Expert parallelism: MoE experts sharded over a process group, tokens exchanged with all-to-all.

* :mod:`.layer` -- :class:`ExpertParallelMoEMLP`: the shared router and experts of ``splitgrad.models`` with an
  all-to-all dispatcher between them; :mod:`.model` -- :class:`ExpertParallelMoEGPT`;
* :mod:`.dispatcher`, :mod:`.all_to_all` -- the token exchange (split sizes, dispatch, combine, autograd);
* :mod:`.dispatch_wgrad` -- the experts' deferred weight gradients inside the dispatch backward;
* :mod:`.grad_sync` -- :class:`ExpertDataParallel` (expert-DP and DP reductions from the wgrad hooks);
* :mod:`.state` -- :func:`full_state_names` (single-process names of the sharded experts), :func:`load_full_state_dict`;
* :mod:`.overlap` -- batch-level overlap (:func:`overlapped_forward_backward`, :class:`OverlappedMoEStage`).
"""

from __future__ import annotations

from .grad_sync import ExpertDataParallel, ParameterGroup, is_expert_parameter
from .layer import ExpertParallelMoEMLP
from .model import ExpertParallelMoEGPT
from .overlap import OverlappedMoEStage, overlapped_forward_backward, set_wgrad_in_dispatch
from .state import full_state_names, load_full_state_dict

__all__ = [
    "ExpertDataParallel",
    "ExpertParallelMoEGPT",
    "ExpertParallelMoEMLP",
    "OverlappedMoEStage",
    "ParameterGroup",
    "full_state_names",
    "is_expert_parameter",
    "load_full_state_dict",
    "overlapped_forward_backward",
    "set_wgrad_in_dispatch",
]
