"""Capture order: which graph of which (stage, microbatch) is captured when.

Graphs of one :func:`~splitgrad.graphs.make_graphed_callables` call share a memory pool, so they are captured
in the order the runtime will replay them. The order uses the pipeline vocabulary of
:mod:`splitgrad.pipeline.actions` — ``"<stage><kind><microbatch>"`` with kind ``F`` (forward graph), ``B``
(backward graph: input gradient and every weight gradient that is not deferred), ``W`` (wgrad graph,
``backward_dw()``) or ``BW`` (``B`` then ``W``) — so a rank's action list from a schedule can be passed as is.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from ..pipeline.ir.actions import AnyAction

__all__ = ["GraphAction", "default_order", "normalize_order"]


class GraphAction(NamedTuple):
    """Capture step ``kind`` (``F``/``B``/``W``) of ``microbatch`` of the callable with stage id ``stage``."""

    stage: int
    kind: str
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"


def _as_action(item: object) -> AnyAction:
    """One order entry as a pipeline action: strings in the pipeline grammar, ``Action``/``OverlapAction``
    as they are, any other object with ``stage``/``kind``/``microbatch`` attributes converted."""
    # One torch-free grammar, shared with the pipeline; imported when an order is given, so that
    # ``make_graphed_callables`` alone does not load ``splitgrad.pipeline``.
    from ..pipeline.ir.actions import Action, OverlapAction, parse_action

    if isinstance(item, (Action, OverlapAction)):
        return item
    if isinstance(item, str):
        try:
            return parse_action(item)
        except ValueError as exc:
            raise ValueError(f"cannot parse capture-order entry {item!r}: {exc}") from None
    try:
        stage, kind, microbatch = item.stage, item.kind, item.microbatch  # type: ignore[attr-defined]
    except AttributeError:
        raise ValueError(
            f"capture-order entry {item!r} is neither a string like '0F1' nor an action with "
            "stage/kind/microbatch attributes"
        ) from None
    name = str(getattr(kind, "value", kind)).rsplit(".", 1)[-1]  # tolerate enum reprs such as 'ActionKind.F'
    text = f"{int(stage)}{name}" + ("" if microbatch is None else str(int(microbatch)))
    try:
        return parse_action(text)
    except ValueError:
        raise ValueError(
            f"capture-order entry {item!r} has unknown kind {name!r}; expected F, B, W, BW, R or RF"
        ) from None


def _parse(item: object) -> list[GraphAction]:
    """One order entry -> its capture steps, read with the pipeline's action grammar
    (:func:`splitgrad.pipeline.actions.parse_action`).

    ``BW`` captures ``B`` then ``W``; an overlapped pair (``"0F3+3BW1"``) captures both parts, forward first;
    gradient-sync points (``"0R"``, ``"0RF"``) capture nothing.
    """
    from ..pipeline.ir.actions import SYNC_KINDS, ActionKind

    steps: list[GraphAction] = []
    for part in _as_action(item).parts:
        if part.kind in SYNC_KINDS:
            continue
        if part.stage < 0 or part.microbatch is None or part.microbatch < 0:
            raise ValueError(f"capture-order entry {item!r}: stage and microbatch must be >= 0")
        kinds = ("B", "W") if part.kind is ActionKind.BW else (part.kind.value,)
        steps.extend(GraphAction(part.stage, kind, part.microbatch) for kind in kinds)
    return steps


def default_order(defers: Sequence[bool]) -> list[GraphAction]:
    """The order of an ordinary training step: every forward, every backward in reverse (one
    ``loss.backward()``), then every wgrad in reverse (``backward_dw`` from the last layer down, as
    :func:`splitgrad.backward_dw` drains a model). ``defers[i]``: callable ``i`` has a wgrad graph.

    The wgrad graphs come after *all* backward graphs on purpose: a wgrad graph captured between two backward
    graphs but replayed after both would overwrite (shared pool) what the later backward graph saved for its
    own wgrad.
    """
    n = len(defers)
    order = [GraphAction(i, "F", 0) for i in range(n)]
    order += [GraphAction(i, "B", 0) for i in reversed(range(n))]
    order += [GraphAction(i, "W", 0) for i in reversed(range(n)) if defers[i]]
    return order


def normalize_order(
    order: Iterable[object], *, stages: Sequence[int], defers: Sequence[bool]
) -> tuple[list[GraphAction], int]:
    """Validate a capture order and map its stage ids to callable indices.

    Args:
        order: entries like ``"0F1"`` or pipeline ``Action`` objects.
        stages: ``stages[i]`` is the stage id callable ``i`` answers to in ``order``.
        defers: ``defers[i]`` says whether callable ``i`` defers weight gradients (then each of its
            microbatches needs exactly one ``W``; otherwise it must have none).

    Returns:
        ``(actions, num_microbatches)``, actions with callable indices instead of stage ids; BW split in two.

    Raises:
        ValueError: malformed entries, unknown stages, missing/duplicate steps, or steps out of order.
    """
    index_of = {stage: i for i, stage in enumerate(stages)}
    if len(index_of) != len(stages):
        raise ValueError(f"stage ids must be distinct, got {list(stages)=}")
    actions: list[GraphAction] = []
    for item in order:
        for action in _parse(item):
            if action.stage not in index_of:
                raise ValueError(
                    f"capture-order entry {str(action)!r} names stage {action.stage}, but the callables answer "
                    f"to stages {list(stages)}"
                )
            actions.append(action._replace(stage=index_of[action.stage]))
    if not actions:
        raise ValueError("capture order is empty")
    num_microbatches = max(a.microbatch for a in actions) + 1
    seen: dict[tuple[int, int], list[str]] = {}
    for action in actions:
        steps = seen.setdefault((action.stage, action.microbatch), [])
        name = f"{stages[action.stage]}{action.kind}{action.microbatch}"
        if action.kind in steps:
            raise ValueError(f"capture order has {name!r} twice")
        if action.kind == "B" and "F" not in steps:
            raise ValueError(f"capture order has {name!r} before the forward of that microbatch")
        if action.kind == "W" and "B" not in steps:
            raise ValueError(f"capture order has {name!r} before the backward of that microbatch")
        if action.kind == "W" and not defers[action.stage]:
            raise ValueError(
                f"capture order has {name!r}, but stage {stages[action.stage]} defers no weight gradient "
                "(no layer in it has delay_wgrad_compute=True); drop its W entries"
            )
        steps.append(action.kind)
    for i, stage in enumerate(stages):
        for mb in range(num_microbatches):
            need = ["F", "B", "W"] if defers[i] else ["F", "B"]
            missing = [k for k in need if k not in seen.get((i, mb), [])]
            if missing:
                raise ValueError(
                    f"capture order lacks {', '.join(f'{stage}{k}{mb}' for k in missing)} "
                    f"({num_microbatches=} inferred from the largest microbatch index)"
                )
    return actions, num_microbatches
