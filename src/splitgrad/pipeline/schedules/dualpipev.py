"""DualPipeV (DeepSeek-V3 report; the "cut-in-half" DualPipe): a V of two stages per rank.

Same placement as ZB-V. In the main phase each rank pairs the forward of one stage with the full backward of
the other; DualPipe runs such a pair as one overlapped chunk (``overlapped_forward_backward``) so that one's
communication hides behind the other's compute. Here a pair is one
:class:`~splitgrad.pipeline.ir.actions.OverlapAction` (``"0F3+3BW1"``): the simulator credits ``overlap`` of its shorter
part (default none), and a runtime hands it to the stage's ``overlapped_forward_backward`` or runs the parts in
order. ``overlap=False`` writes the pairs as two consecutive actions instead. The start and the tail use split
backwards with one first-in-first-out queue of pending weight gradients per rank, as DualPipe's
``WeightGradStore`` does.

The order is DeepSeek's DualPipeV action for action (also torch's ``ScheduleDualPipeV``, checked in the tests),
including its one exception: the last rank runs its first main-phase forward and backward apart ("we don't
overlap these two chunks to further reduce bubble size"). ``pair_last_rank_first=True`` pairs them too, as
splitgrad did before: in the simulator that is up to one forward faster when the overlap hides most of the
shorter part and messages are free, and slower as soon as a message costs time or the overlap hides little.
"""

from __future__ import annotations

from ..ir._perf import gc_paused
from ..ir.actions import Schedule
from ._common import RankProgram, check_v_shape, finish, v_mapping

__all__ = ["dualpipev"]


@gc_paused()
def dualpipev(
    n_stages: int, n_microbatches: int, *, overlap: bool = True, pair_last_rank_first: bool = False
) -> Schedule:
    """DualPipeV over ``n_stages / 2`` ranks; needs ``n_microbatches >= n_stages``.

    Args:
        n_stages: model stages (even).
        n_microbatches: microbatches per step.
        overlap: write each main-phase forward/backward pair as one overlapped ``F+BW`` action.
        pair_last_rank_first: also pair the last rank's first main-phase forward and backward (DeepSeek's
            DualPipeV runs them apart; see the module docstring for when pairing them is faster).

    Raises:
        ValueError: ``n_stages`` odd, or fewer microbatches than stages.
    """
    check_v_shape("dualpipev", n_stages, n_microbatches)
    if n_microbatches < n_stages:
        raise ValueError(
            f"dualpipev needs at least as many microbatches as stages, got {n_microbatches=} {n_stages=}"
        )
    p, m = n_stages // 2, n_microbatches
    programs = []
    for rank in range(p):
        down, up = rank, 2 * p - 1 - rank
        prog = RankProgram()
        # Step 1: nF0
        for _ in range(2 * (p - rank - 1)):
            prog.forward(down)
        # Step 2: nF0F1
        for _ in range(rank + 1):
            prog.forward(down)
            prog.forward(up)
        # Step 3: nB1W1F1 (zero bubble: the weight gradient right after its input gradient)
        for _ in range(p - rank - 1):
            prog.backward(up)
            prog.weight()
            prog.forward(up)
        # Step 4 (main): nF0B1F1B0, each forward paired with the other stage's full backward; the last rank
        # runs its first pair apart, as DeepSeek's DualPipeV does
        for i in range(m - 2 * p + rank + 1):
            prog.forward(down)
            prog.full_backward(up)
            if overlap and (i > 0 or rank < p - 1 or pair_last_rank_first):
                prog.overlap_last_two()
            prog.forward(up)
            prog.full_backward(down)
            if overlap:
                prog.overlap_last_two()
        # Step 5: nB1F1B0
        for _ in range(p - rank - 1):
            prog.full_backward(up)
            prog.forward(up)
            prog.full_backward(down)
            if overlap:
                prog.overlap_last_two()
        # Step 6: nB1B0, the second half with split backwards (weight gradients queued)
        split = False
        for i in range(rank + 1):
            if i == (rank + 1) // 2 and rank % 2 == 1:
                split = True
            prog.backward(up) if split else prog.full_backward(up)
            if i == (rank + 1) // 2 and rank % 2 == 0:
                split = True
            prog.backward(down) if split else prog.full_backward(down)
        # Step 7: nWB0, a queued weight gradient before each remaining input gradient
        for _ in range(p - rank - 1):
            prog.weight()
            prog.backward(down)
        # Step 8: nW
        prog.drain()
        programs.append(prog)
    return finish("dualpipev", m, v_mapping(p), programs)
