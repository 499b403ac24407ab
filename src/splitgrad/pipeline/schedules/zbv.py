"""ZB-V (Qi et al., ICLR 2024, section 6): two stages per rank in a V, split backward, zero bubble.

Rank ``r`` of ``p`` holds stage ``r`` (on the way down) and stage ``2p - 1 - r`` (on the way back up), so the
first and last stage share rank 0 and a microbatch's forward turns around on rank ``p - 1`` without a
transfer. With equal costs ``F = B = W`` the schedule has no bubble once ``m >= 2p - 1`` while each rank holds
at most ``2p`` half-size stage activations, i.e. 1F1B's peak memory.
"""

from __future__ import annotations

from ..ir._perf import gc_paused
from ..ir.actions import ActionKind, Schedule
from ._common import RankProgram, check_v_shape, finish, v_mapping

__all__ = ["zbv"]


@gc_paused()
def zbv(n_stages: int, n_microbatches: int) -> Schedule:
    """ZB-V over ``n_stages / 2`` ranks.

    Fewer than ``2p - 1`` microbatches are handled by writing the pattern for ``2p - 1`` and dropping the
    surplus microbatches (valid, but no longer bubble-free).

    Raises:
        ValueError: ``n_stages`` is not even.
    """
    check_v_shape("zbv", n_stages, n_microbatches)
    p = n_stages // 2
    n = max(n_microbatches, 2 * p - 1)
    F = ActionKind.F
    programs = []
    for rank in range(p):
        down, up = rank, 2 * p - 1 - rank
        prog = RankProgram()
        # Phase 1: forwards of the down stage until the first microbatch has come back up to this rank.
        for _ in range(2 * (p - rank) - 1):
            prog.forward(down)
        # Phase 2: the up stage starts; keep the down stage fed in between.
        for _ in range(rank):
            prog.forward(up)
            prog.forward(down)
        # Phase 3: up-stage F B W while the down stage's first input gradient travels back.
        for _ in range(p - rank):
            prog.forward(up)
            prog.backward(up)
            prog.weight(up)
        # Phase 4: steady state, one F B W on each stage.
        while prog.count(up, F) < n:
            if prog.count(down, F) < n:
                prog.forward(down)
            prog.backward(down)
            prog.weight(down)
            prog.forward(up)
            prog.backward(up)
            prog.weight(up)
        # Phase 5: drain; input gradients first, weight gradients deferred to fill the tail.
        for _ in range(rank):
            prog.backward(down)
            prog.backward(up)
        for _ in range(p - rank):
            prog.backward(down)
            prog.weight(down)
        # Phase 6: the deferred weight gradients.
        while prog.weight(up):
            pass
        prog.drain()
        programs.append(prog)
    return finish("zbv", n_microbatches, v_mapping(p), programs)
