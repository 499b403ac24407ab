"""Interleaved 1F1B (Narayanan et al., 2021; Megatron-LM's virtual pipeline): several stages per rank.

Rank ``r`` of ``p`` holds stages ``r, r + p, ..., r + (v - 1) p`` (``v = stages_per_rank``), so a microbatch
loops through the ranks ``v`` times and the fill/drain bubble shrinks by ``v``. Microbatches go through the
chunks in groups of ``p``, which is why ``n_microbatches`` must be a multiple of ``p``.

``overlap=True`` gives Megatron-Core's combined 1F1B under virtual pipelining
(``--overlap-moe-expert-parallel-comm``): one more warm-up forward per rank, then the steady state as
overlapped ``F+B`` pairs (:func:`~splitgrad.pipeline.passes.fuse_overlap_pairs` with its default look-ahead),
so each pair's expert all-to-alls can hide behind the other part's compute.
"""

from __future__ import annotations

from ..ir._perf import gc_paused
from ..ir.actions import Schedule
from ..passes.overlap import fuse_overlap_pairs
from ._common import RankProgram, check_positive_int, finish, loop_mapping

__all__ = ["interleaved_1f1b"]


@gc_paused()
def interleaved_1f1b(
    n_stages: int,
    n_microbatches: int,
    *,
    stages_per_rank: int = 2,
    split_backward: bool = False,
    overlap: bool = False,
) -> Schedule:
    """Interleaved 1F1B over ``n_stages / stages_per_rank`` ranks.

    Args:
        n_stages: total model stages; a multiple of ``stages_per_rank``.
        n_microbatches: a multiple of the number of ranks.
        stages_per_rank: virtual stages (model chunks) per rank, ``>= 2``.
        split_backward: write ``B`` + ``W`` instead of ``BW``.
        overlap: Megatron-Core's combined 1F1B: the steady state as overlapped ``F+B`` pairs after one more
            warm-up forward (named ``"interleaved-1f1b+overlap"``).

    Raises:
        ValueError: the counts do not divide as required, or ``overlap`` with too few microbatches for a pair.
    """
    check_positive_int(
        "interleaved-1f1b", n_stages=n_stages, n_microbatches=n_microbatches, stages_per_rank=stages_per_rank
    )
    v = stages_per_rank
    if v < 2:
        raise ValueError(
            f"interleaved-1f1b needs stages_per_rank >= 2 (use '1f1b' for one), got {stages_per_rank=}"
        )
    if n_stages % v:
        raise ValueError(
            f"interleaved-1f1b: n_stages must be a multiple of stages_per_rank, got {n_stages=} {v=}"
        )
    p = n_stages // v
    m = n_microbatches
    if m % p:
        raise ValueError(
            f"interleaved-1f1b: n_microbatches must be a multiple of the number of ranks "
            f"({p} = n_stages / stages_per_rank), got {n_microbatches=} {n_stages=} {stages_per_rank=}"
        )
    total = m * v  # (chunk, microbatch) pairs per rank
    group = p * v

    def chunk(k: int, backward: bool) -> int:
        c = (k % group) // p
        return v - 1 - c if backward else c

    programs = []
    for rank in range(p):
        prog = RankProgram()

        def forward(k: int, rank: int = rank, prog: RankProgram = prog) -> None:
            prog.forward(chunk(k, backward=False) * p + rank)

        def backward(k: int, rank: int = rank, prog: RankProgram = prog) -> None:
            stage = chunk(k, backward=True) * p + rank
            if split_backward:
                prog.backward(stage)
                prog.weight(stage)
            else:
                prog.full_backward(stage)

        warmup = min(total, 2 * (p - rank - 1) + (v - 1) * p)
        # Phase 1: warm-up forwards; lower ranks run more so every chunk is fed before the first backward.
        for k in range(warmup):
            forward(k)
        # Phase 2: steady state, the (warmup + k)-th forward then the k-th backward.
        for k in range(total - warmup):
            forward(warmup + k)
            backward(k)
        # Phase 3: cool-down backwards.
        for k in range(total - warmup, total):
            backward(k)
        programs.append(prog)
    plain = finish("interleaved-1f1b", m, loop_mapping(n_stages, p), programs)
    return fuse_overlap_pairs(plain) if overlap else plain
