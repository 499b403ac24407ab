"""The overlap pass: a 1F1B or interleaved 1F1B schedule rewritten into overlapped ``F+B`` pairs.

Megatron-Core's combined 1F1B (``--overlap-moe-expert-parallel-comm``) and DualPipe run the steady state as
pairs "forward of microbatch ``j + k``, backward of microbatch ``j``", so each part's all-to-alls hide behind the
other's compute; :func:`fuse_overlap_pairs` is that rewrite as a schedule pass. Per rank, keeping the input's
order of forwards and of backwards: ``k`` warm-up forwards, then the pairs ``F(j + k)+B(j)`` (an
:class:`~splitgrad.pipeline.ir.actions.OverlapAction`), then the cool-down backwards; a ``W`` follows the unit that
holds its ``B``.

Why ``k = 2 (p - 1 - r) + 1`` on rank ``r`` of ``p`` by default, not 1F1B's ``p - 1 - r`` plus the one forward
a pair pulls up: a pair cannot start before both inputs exist, so with ``p - r`` warm-up forwards a rank's pair
``j`` waits for the next rank's pair ``j``, which waits for this rank's pair ``j - 1``: the two ranks alternate
and the steady state takes two pair times per microbatch, slower than plain 1F1B even with full overlap. One more
forward of slack per downstream rank (DualPipe's deeper warm-up) lets the neighbours' pairs run side by side:
at ``overlap=0`` the simulated makespan equals 1F1B's, and every hidden fraction shortens it (``p = 4``,
``m = 8``, ``f = 1``, ``b = 2``: 33 plain, 29.5 at ``overlap=0.5``, 26 at 1). The price is activation memory:
``2 (p - r)`` microbatches in flight on rank ``r`` instead of ``p - r``.

With ``v`` stages per rank on the loop placement (interleaved 1F1B, Megatron's virtual pipeline: rank ``r``
holds ``r, r + p, ...``) the default is Megatron-Core's combined-1F1B warm-up,
``k = 2 (p - 1 - r) + (v - 1) p + 1``: its interleaved warm-up (``microbatch_group_size_per_vp_stage = p``)
plus the one extra forward that ``--overlap-moe-expert-parallel-comm`` adds. Without the extra forward the
last rank's first pair would hold the forward and the backward of the same (stage, microbatch), which cannot
overlap (the backward needs the forward's output). Its pairs are Megatron's: forward ``j + k`` with backward
``j`` in the interleaved order of each. At ``v = 1`` the formula is the default above.

The pair costs ``f + b - overlap * min(f, b)`` in :func:`~splitgrad.pipeline.simulate` (``overlap=``); the
runtime hands both parts to the stage's ``overlapped_forward_backward`` (e.g. an
:class:`~splitgrad.parallel.expert.OverlappedMoEStage`), or runs them in order.
"""

from __future__ import annotations

from ..ir.actions import SYNC_KINDS, Action, ActionKind, AnyAction, OverlapAction, Schedule
from ..ir.validate import validate

__all__ = ["default_lookahead", "fuse_overlap_pairs"]

_BACKWARD = (ActionKind.B, ActionKind.BW)


def default_lookahead(n_ranks: int, rank: int, stages_per_rank: int = 1) -> int:
    """Warm-up forwards of ``rank`` before its first pair: ``2 (p - 1 - rank) + (v - 1) p + 1`` with ``p =
    n_ranks`` and ``v = stages_per_rank`` (Megatron-Core's combined 1F1B; see the module doc)."""
    return 2 * (n_ranks - 1 - rank) + (stages_per_rank - 1) * n_ranks + 1


def _rank_pairs(acts: tuple[AnyAction, ...], k: int, rank: int, name: str) -> list[AnyAction]:
    odd = [a for a in acts if type(a) is not Action or a.kind in SYNC_KINDS]
    if odd:
        raise ValueError(
            f"fuse_overlap_pairs: rank {rank} of {name!r} already holds {odd[0]} (overlapped pairs or sync "
            "points); apply this pass to the plain schedule, then add_grad_sync"
        )
    forwards = [a for a in acts if a.kind is ActionKind.F]
    backwards = [a for a in acts if a.kind in _BACKWARD]
    weights = {(a.stage, a.microbatch): a for a in acts if a.kind is ActionKind.W}
    k = min(k, len(forwards))
    out: list[AnyAction] = list(forwards[:k])

    def backward_done(b: Action) -> None:
        w = weights.get((b.stage, b.microbatch))
        if w is not None:
            out.append(w)

    for j, b in enumerate(backwards):
        if j + k < len(forwards):
            out.append(OverlapAction(forwards[j + k], b))
        else:
            out.append(b)
        backward_done(b)
    return out


def fuse_overlap_pairs(schedule: Schedule, *, lookahead: list[int] | None = None) -> Schedule:
    """Rewrite a 1F1B-like schedule (``1f1b``, ``gpipe``, ``interleaved-1f1b``) into warm-up, ``F+B`` pairs,
    cool-down.

    Args:
        schedule: a complete schedule without overlapped pairs or sync points, with one stage per rank (e.g.
            ``build_schedule("1f1b", p, m)``, also with ``split_backward=True``) or ``v`` stages per rank on the
            loop placement (``build_schedule("interleaved-1f1b", v * p, m, stages_per_rank=v)``); add sync
            points after.
        lookahead: per rank, the warm-up forwards before the first pair (``k``: pairs are ``F(j + k)+B(j)``,
            counting the rank's forwards and backwards in its order); default :func:`default_lookahead`.
            Clipped to the rank's number of forwards.

    Returns:
        A new, validated schedule named ``"<name>+overlap"``, same stage-to-rank mapping and microbatches.

    Raises:
        ValueError: the stages are not one per rank or on the loop placement (a V: ``dualpipev`` builds its own
            pairs); the schedule holds pairs or sync points; ``lookahead`` has the wrong length or a value below
            1; or no pair results (``n_microbatches`` too small).
        ScheduleError: the rewritten schedule is not valid (a ``lookahead`` too small for the dependencies).
    """
    p, n = schedule.n_ranks, schedule.n_stages
    if n % p or schedule.stage_to_rank != tuple(s % p for s in range(n)):
        raise ValueError(
            f"fuse_overlap_pairs: needs one stage per rank or the interleaved (loop) placement, {schedule.name!r} "
            f"places its {n} stages on {p} ranks as {schedule.stage_to_rank} (dualpipev builds its own pairs: "
            "build_schedule('dualpipev', ...))"
        )
    v = n // p
    ks = [default_lookahead(p, r, v) for r in range(p)] if lookahead is None else [int(k) for k in lookahead]
    if len(ks) != p or min(ks) < 1:
        raise ValueError(
            f"fuse_overlap_pairs: lookahead must give one value >= 1 per rank ({p}), got {lookahead=}"
        )
    lists = [_rank_pairs(acts, ks[r], r, schedule.name) for r, acts in enumerate(schedule.rank_actions)]
    if not any(type(a) is OverlapAction for acts in lists for a in acts):
        raise ValueError(
            f"fuse_overlap_pairs: no pair in {schedule.name!r} with {schedule.n_microbatches} microbatches and "
            f"{ks=} warm-up forwards (needs n_microbatches > lookahead on some rank)"
        )
    out = Schedule(
        name=f"{schedule.name}+overlap",
        n_microbatches=schedule.n_microbatches,
        stage_to_rank=schedule.stage_to_rank,
        rank_actions=tuple(tuple(acts) for acts in lists),
    )
    validate(out)
    return out
