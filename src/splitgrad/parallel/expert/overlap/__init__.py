"""Batch-level overlap of expert-parallel MoE models: one microbatch's forward while another's backward runs.

* :mod:`.pair` -- :func:`overlapped_forward_backward`, :class:`OverlappedMoEStage` (the pipeline runtime's
  ``F+B`` pair), :func:`set_wgrad_in_dispatch`;
* :mod:`.driver` -- the single-thread driver: the forward advanced one step at each backward exchange;
* :mod:`.probe` -- load-independent measurements of the pair (CPU time, context switches).
"""

from __future__ import annotations

from .pair import OverlappedMoEStage, overlapped_forward_backward, set_wgrad_in_dispatch

__all__ = ["OverlappedMoEStage", "overlapped_forward_backward", "set_wgrad_in_dispatch"]
