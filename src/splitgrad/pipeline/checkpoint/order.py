"""In which order a schedule adds each microbatch's gradient to a stage's parameters (torch-free).

Why it matters for resuming: the weights after step ``k`` are the optimizer's function of the gradients, and a
gradient is a floating-point sum over microbatches whose value depends on the order of the additions. Two
schedules that add the microbatches of every stage in the same order run the same operations on the same
operands, so a run checkpointed under one and resumed under the other continues **bitwise** like the
uninterrupted run; otherwise only up to rounding.

A stage's parameters get their gradient in one of two places: in ``B`` (plain autograd parameters:
embeddings, ``torch.nn`` layers, splitgrad layers without ``delay_wgrad_compute``) or in ``W`` (the deferred
weight gradients of splitgrad layers, all of a layer's parameters at once); ``BW`` is both, one after the
other, and an overlapped pair contributes its backward part. Each parameter takes one of the two paths, so
what fixes its arithmetic is the order of the stage's ``B`` contributions, or of its ``W`` contributions.
"""

from __future__ import annotations

from ..ir.actions import ActionKind, Schedule

__all__ = ["gradient_order", "same_gradient_order"]


def gradient_order(schedule: Schedule) -> dict[int, tuple[tuple[int, ...], tuple[int, ...]]]:
    """Per stage, ``(microbatches in the order of their B contributions, ... of their W contributions)``.

    A ``BW`` counts in both, an :class:`~splitgrad.pipeline.ir.actions.OverlapAction` by its backward part;
    ``F`` and the gradient-sync points add no gradient. Example: ``zb-h1`` on 2 stages and 4 microbatches gives
    ``{0: ((0, 1, 2, 3), (0, 1, 2, 3)), 1: ((0, 1, 2, 3), (0, 1, 2, 3))}``, as ``1f1b`` does.
    """
    b_order: dict[int, list[int]] = {s: [] for s in range(schedule.n_stages)}
    w_order: dict[int, list[int]] = {s: [] for s in range(schedule.n_stages)}
    for actions in schedule.rank_actions:
        for action in actions:
            for part in action.parts:
                if part.kind in (ActionKind.B, ActionKind.BW):
                    b_order[part.stage].append(part.microbatch)
                if part.kind in (ActionKind.W, ActionKind.BW):
                    w_order[part.stage].append(part.microbatch)
    return {s: (tuple(b_order[s]), tuple(w_order[s])) for s in range(schedule.n_stages)}


def same_gradient_order(a: Schedule, b: Schedule) -> bool:
    """Whether ``a`` and ``b`` add every stage's microbatch gradients in the same order (same stages and
    microbatches): then a step under either is the same arithmetic, bitwise, whatever the rank layout."""
    if (a.n_stages, a.n_microbatches) != (b.n_stages, b.n_microbatches):
        return False
    return gradient_order(a) == gradient_order(b)
