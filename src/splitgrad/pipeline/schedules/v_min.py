"""V-Min (Qi, Wan, Amar, Lin, "Pipeline Parallelism with Controllable Memory", NeurIPS 2024): a V schedule at
about a third of 1F1B's activation memory.

Rank ``r`` of ``p`` holds stage ``r`` (down) and ``2p - 1 - r`` (up), as ``zbv``. The building block is the
tightest the V allows: every pass starts one slot after the pass it consumes, and the turns on rank ``p - 1``
are immediate, so a microbatch's two activations on a rank live about ``4p`` slots together (``6`` slots per
microbatch): a rank holds ``2 * floor((p + 4) / 3)`` stage activations at most, against 1F1B's ``2p``
half-size ones. The price is a bubble of about ``2p / 3m`` at ``F = B = W``, worse when they differ (the block
has no slack to absorb an ``F`` longer than a ``W``). See :mod:`._v_blocks` for how the schedule is generated.
"""

from __future__ import annotations

from ..ir._perf import gc_paused
from ..ir.actions import Schedule
from ._v_blocks import v_block_schedule

__all__ = ["v_min", "v_min_block", "v_min_peak"]


def v_min_block(p: int) -> list[tuple[int, int, int, int]]:
    """Per rank, the slots of microbatch 0's down ``F``, up ``F``, up ``B`` and down ``B`` (unit costs).

    Rank 0's up-stage ``B`` (the loss) waits two slots more when ``3 | p``: otherwise one of its passes would
    share a slot of the 6-slot period with another microbatch's.
    """
    gap = 2 if p % 3 == 0 else 0
    return [(r, 2 * p - 1 - r, 2 * p + gap + r, 4 * p + gap - 1 - r) for r in range(p)]


def v_min_peak(p: int) -> int:
    """Most stage activations a rank holds under V-Min with enough microbatches: ``2 * floor((p + 4) / 3)``."""
    return 2 * ((p + 4) // 3)


@gc_paused()
def v_min(n_stages: int, n_microbatches: int) -> Schedule:
    """V-Min over ``n_stages / 2`` ranks (any ``n_microbatches >= 1``).

    Raises:
        ValueError: ``n_stages`` is not even.
    """
    return v_block_schedule("v-min", n_stages, n_microbatches, v_min_block)
