"""Schedule passes: ``Schedule -> Schedule`` rewrites, so that what a runtime does is in the schedule, as data.

torch.distributed.pipelining lowers its compute-only schedules the same way; the simulator, the timelines and
the golden files then see what the runtime will do. All torch-free:

* :func:`add_grad_sync` / :func:`strip_grad_sync` (:mod:`~.grad_sync`): the data-parallel gradient-sync points
  ``R`` and ``RF`` of every stage;
* :func:`fuse_overlap_pairs` (:mod:`~.overlap`): a one-stage-per-rank schedule (``1f1b``) as warm-up forwards,
  overlapped ``F+B`` pairs and cool-down backwards; run it before :func:`add_grad_sync`;
* :func:`refill_w` (:mod:`~.w_refill`): a schedule's weight gradients re-placed for given costs, keeping every
  rank's ``F``/``B`` order (what zbv-auto runs on its best plans).
"""

from __future__ import annotations

from .grad_sync import add_grad_sync, has_grad_sync, strip_grad_sync
from .overlap import default_lookahead, fuse_overlap_pairs
from .w_refill import refill_w

__all__ = [
    "add_grad_sync",
    "default_lookahead",
    "fuse_overlap_pairs",
    "has_grad_sync",
    "refill_w",
    "strip_grad_sync",
]
