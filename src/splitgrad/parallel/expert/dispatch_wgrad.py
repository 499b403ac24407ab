"""The experts' deferred weight gradients, run while the backward's dispatch all-to-all is in flight.

Megatron-Core's ``--delay-wgrad-compute`` with batch-level overlap: in an MoE layer's backward the last exchange
is the dispatch's (expert input gradients back to the tokens' ranks); the experts' weight gradients do not
depend on it, so they fill it. :class:`~splitgrad.parallel.expert.ExpertParallelMoEMLP` calls
:func:`run_expert_wgrad` from the dispatch backward, between starting the exchange and waiting for it, when its
``wgrad_in_dispatch`` is on (``overlapped_forward_backward`` turns it on for its backward part).

Only work that keeps the accumulation order runs: a store's owed tasks run when all of them sit where this
backward parked its own (the layer's queue, or the open ``capture_wgrad`` bundle), in deferral order, exactly
what a later ``backward_dw`` / ``bundle.run()`` would have done first. Anything else (an older bundle of this
layer still unrun, a pending wgrad-graph replay) leaves the layer's work deferred as before. Each task settles
where it was owed and fires its owner's hooks once; ``backward_dw`` / the bundle then skip it.
"""

from __future__ import annotations

import logging
import time

from torch import nn

from ...core.bundle import active_bundle

__all__ = ["run_expert_wgrad"]

logger = logging.getLogger(__name__)


def run_expert_wgrad(experts: list[nn.Module], log: list | None = None) -> int:
    """Run the owed deferred weight-gradient tasks of ``experts`` now, if that keeps the accumulation order.

    Args:
        experts: split-capable modules (``fc1``, ``fc2`` of an MoE layer), each with a ``wgrad_store``.
        log: when given, appends ``("expert wgrad", start, end)`` (``time.perf_counter()`` seconds) if any
            task ran.

    Returns:
        How many tasks ran (0 when nothing was deferred or running now would reorder the accumulation).
    """
    start = time.perf_counter()
    bundle = active_bundle()
    ran = 0
    for module in experts:
        store = module.wgrad_store
        owed = store.outstanding
        if owed.total == 0:
            continue
        if bundle is None:
            if owed.queued != owed.total:
                logger.debug("%s: older wgrad work outside its queue (%s); left deferred", store.name, owed)
                continue
            while len(store):
                store.run_next()  # FIFO, as backward_dw: the same accumulation order
                ran += 1
        else:
            mine = [t for t in bundle.tasks if t.store is store and t.owed]
            if len(mine) != owed.total:
                logger.debug("%s: wgrad work owed outside this bundle (%s); left deferred", store.name, owed)
                continue
            for task in mine:  # deferral order, as bundle.run()
                task.run()
                ran += 1
    if ran and log is not None:
        log.append(("expert wgrad", start, time.perf_counter()))
    return ran
