"""V-Half (Qi, Wan, Amar, Lin, "Pipeline Parallelism with Controllable Memory", NeurIPS 2024): a V schedule at
about half of 1F1B's activation memory and close to zero bubble.

Rank ``r`` of ``p`` holds stage ``r`` (down) and ``2p - 1 - r`` (up), as ``zbv``. In the building block a pass
going down the V starts two slots after the pass it consumes (one free slot between them), a pass going up one
slot after; so a microbatch's two activations on a rank live about ``6p`` slots together (``6`` slots per
microbatch), and a rank holds ``2 * floor((p + 2) / 2)`` stage activations at most, against 1F1B's ``2p``
half-size ones. The free slots give the slack that keeps the bubble near zero when ``W + 2B >= 2F`` and
``W + 2F >= 2B``. See :mod:`._v_blocks` for how the schedule is generated.
"""

from __future__ import annotations

from ..ir._perf import gc_paused
from ..ir.actions import Schedule
from ._v_blocks import v_block_schedule

__all__ = ["v_half", "v_half_block", "v_half_peak"]


def v_half_block(p: int) -> list[tuple[int, int, int, int]]:
    """Per rank, the slots of microbatch 0's down ``F``, up ``F``, up ``B`` and down ``B`` (unit costs).

    The input gradients start three slots later when ``p`` is even: otherwise one of a rank's passes would
    share a slot of the 6-slot period with another microbatch's.
    """
    gap = 3 if p % 2 == 0 else 0
    return [(2 * r, 3 * p - 2 - r, 3 * p + gap + 2 * r - 1, 6 * p + gap - r - 2) for r in range(p)]


def v_half_peak(p: int) -> int:
    """Most stage activations a rank holds under V-Half with enough microbatches: ``2 * floor((p + 2) / 2)``."""
    return 2 * ((p + 2) // 2)


@gc_paused()
def v_half(n_stages: int, n_microbatches: int) -> Schedule:
    """V-Half over ``n_stages / 2`` ranks (any ``n_microbatches >= 1``).

    Raises:
        ValueError: ``n_stages`` is not even.
    """
    return v_block_schedule("v-half", n_stages, n_microbatches, v_half_block)
