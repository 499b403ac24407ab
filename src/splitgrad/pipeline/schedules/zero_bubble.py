"""ZB-H1 and ZB-H2 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024), one stage per rank.

Both split the backward into ``B`` (input gradient, on the critical path) and ``W`` (weight gradient, free to
move) and use ``W`` to fill what would be bubbles in 1F1B. With equal costs ``F = B = W``:

* ZB-H1 keeps 1F1B's peak memory (``p`` activations) and shrinks the bubble from ``(p - 1)(F + B + W)`` to
  ``(p - 1)(F + B - W)``: rank ``r`` defers its first ``r`` weight gradients to the end.
* ZB-H2 allows ``2p - 1`` activations and has no bubble once ``m >= 2p - 1``: extra warm-up forwards fill the
  start, and in the tail the input gradients run back to back while weight gradients wait, turning 1F1B's
  trapezoid into a parallelogram.
"""

from __future__ import annotations

from ..ir._perf import gc_paused
from ..ir.actions import ActionKind, Schedule
from ._common import RankProgram, check_positive_int, finish, loop_mapping

__all__ = ["zb_h1", "zb_h2"]


@gc_paused()
def zb_h1(n_stages: int, n_microbatches: int) -> Schedule:
    """ZB-H1: 1F1B's order with the first ``r`` weight gradients of rank ``r`` deferred to its end.

    Unit-cost bubble ratio (``m >= p``): ``(p - 1) / (3m + p - 1)``; peak activations ``min(p, m)`` per rank.
    """
    check_positive_int("zb-h1", n_stages=n_stages, n_microbatches=n_microbatches)
    p, m = n_stages, n_microbatches
    programs = []
    for rank in range(p):
        prog = RankProgram()
        # Phase 1: 1F1B's warm-up forwards.
        for _ in range(min(m, p - rank - 1)):
            prog.forward(rank)
        # Phase 2: one forward (while any remain) and one input gradient per step. The first `rank` steps
        # that still have a forward defer their W: that W would otherwise wait for the next input gradient.
        for step in range(m):
            has_forward = prog.count(rank, ActionKind.F) < m
            if has_forward:
                prog.forward(rank)
            prog.backward(rank)
            if step >= rank or not has_forward:
                prog.weight()
        # Phase 3: the deferred weight gradients fill the drain.
        prog.drain()
        programs.append(prog)
    return finish("zb-h1", m, loop_mapping(p, p), programs)


@gc_paused()
def zb_h2(n_stages: int, n_microbatches: int) -> Schedule:
    """ZB-H2: ``2(p - r) - 1`` warm-up forwards on rank ``r``, ``B W F`` steady state, then a tail of
    input gradients paired with the remaining forwards and weight gradients.

    Unit-cost bubble ratio is 0 for ``m >= 2p - 1``; peak activations ``min(2p - 1, m)`` per rank.
    """
    check_positive_int("zb-h2", n_stages=n_stages, n_microbatches=n_microbatches)
    p, m = n_stages, n_microbatches
    # Steps with a full B W F cycle; the first input gradient of the tail then arrives two units (not three)
    # after the previous one, on every rank at once.
    n_steady = max(0, m - 2 * p + 1)
    programs = []
    for rank in range(p):
        prog = RankProgram()
        # Phase 1: warm-up forwards fill the time until the first input gradient comes back.
        for _ in range(min(m, 2 * (p - rank) - 1)):
            prog.forward(rank)
        for step in range(m):
            prog.backward(rank)
            if step < n_steady:
                # Phase 2: steady state B W F.
                prog.weight()
                prog.forward(rank)
            elif prog.count(rank, ActionKind.F) < m:
                # Phase 3: tail, input gradients back to back with the last forwards between them ...
                prog.forward(rank)
            else:
                # ... then with weight gradients between them.
                prog.weight()
        # Phase 4: deferred weight gradients; rank r ends 2r units of W later than rank 0 (the parallelogram).
        prog.drain()
        programs.append(prog)
    return finish("zb-h2", m, loop_mapping(p, p), programs)
