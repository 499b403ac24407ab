"""GPipe and 1F1B: one stage per rank, backward not split (``BW``) unless ``split_backward``.

With ``split_backward=True`` every ``BW`` becomes ``B`` immediately followed by its ``W``: the same order, but
the input gradient is sent as soon as ``B`` ends instead of after ``B + W``, and the runtime exercises the
split path.
"""

from __future__ import annotations

from ..ir._perf import gc_paused
from ..ir.actions import Schedule
from ._common import RankProgram, check_positive_int, finish, loop_mapping

__all__ = ["gpipe", "one_f_one_b"]


def _backward(prog: RankProgram, stage: int, split: bool) -> None:
    if split:
        prog.backward(stage)
        prog.weight(stage)
    else:
        prog.full_backward(stage)


@gc_paused()
def gpipe(n_stages: int, n_microbatches: int, *, split_backward: bool = False) -> Schedule:
    """All forwards, then all backwards (microbatch order), one stage per rank.

    Peak activations per rank: ``n_microbatches``.
    """
    check_positive_int("gpipe", n_stages=n_stages, n_microbatches=n_microbatches)
    programs = []
    for stage in range(n_stages):
        prog = RankProgram()
        for _ in range(n_microbatches):
            prog.forward(stage)
        for _ in range(n_microbatches):
            _backward(prog, stage, split_backward)
        programs.append(prog)
    return finish("gpipe", n_microbatches, loop_mapping(n_stages, n_stages), programs)


@gc_paused()
def one_f_one_b(n_stages: int, n_microbatches: int, *, split_backward: bool = False) -> Schedule:
    """1F1B (PipeDream-flush): warm-up forwards, alternating forward/backward, cool-down backwards.

    Rank ``r`` runs ``min(p - r - 1, m)`` warm-up forwards, so it holds at most ``p - r`` activations.
    With unit costs and ``BW = B + W`` its bubble ratio is ``(p - 1) / (p - 1 + m)``.
    """
    check_positive_int("1f1b", n_stages=n_stages, n_microbatches=n_microbatches)
    p, m = n_stages, n_microbatches
    programs = []
    for stage in range(p):
        prog = RankProgram()
        warmup = min(p - stage - 1, m)
        # Phase 1: warm-up forwards fill the pipeline below this rank.
        for _ in range(warmup):
            prog.forward(stage)
        # Phase 2: steady state, one forward then the oldest backward.
        for _ in range(m - warmup):
            prog.forward(stage)
            _backward(prog, stage, split_backward)
        # Phase 3: cool-down, the backwards still in flight.
        for _ in range(warmup):
            _backward(prog, stage, split_backward)
        programs.append(prog)
    return finish("1f1b", m, loop_mapping(p, p), programs)
