"""Capture order: which graph of which (stage, microbatch) is captured when.

Graphs of one :func:`~splitgrad.graphs.make_graphed_callables` call share a memory pool, so they are captured
in the order the runtime will replay them. The order uses the pipeline vocabulary of
:mod:`splitgrad.pipeline.actions` — ``"<stage><kind><microbatch>"`` with kind ``F`` (forward graph), ``B``
(backward graph: input gradient and every weight gradient that is not deferred), ``W`` (wgrad graph,
``backward_dw()``) or ``BW`` (``B`` then ``W``) — so a rank's action list from a schedule can be passed as is.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import NamedTuple

__all__ = ["GraphAction", "default_order", "normalize_order"]

_KINDS = ("F", "B", "W")


class GraphAction(NamedTuple):
    """Capture step ``kind`` (``F``/``B``/``W``) of ``microbatch`` of the callable with stage id ``stage``."""

    stage: int
    kind: str
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"


def _parse(item: object) -> list[GraphAction]:
    """One order entry (string or any ``(stage, kind, microbatch)`` object) -> its capture steps.

    A pipeline schedule's overlapped pair (``"0F3+3BW1"``, an object with two ``parts``) captures both parts,
    forward first; its gradient-sync points (``"0R"``, ``"0RF"``, kind ``R``/``RF``) capture nothing.
    """
    parts = getattr(item, "parts", None)
    if isinstance(item, str) and "+" in item:
        parts = item.split("+")
    if parts is not None and len(parts) > 1:
        return [step for part in parts for step in _parse(part)]
    if isinstance(item, str):
        if re.fullmatch(r"\d+RF?", item.strip()):
            return []
    elif str(getattr(getattr(item, "kind", None), "value", getattr(item, "kind", None))) in ("R", "RF"):
        return []
    if isinstance(item, str):
        text = item.strip()
        kind = next((k for k in ("BW", "F", "B", "W") if k in text), None)
        head, _, tail = text.partition(kind) if kind else ("", "", "")
        if kind is None or not head.isdigit() or not tail.isdigit():
            raise ValueError(
                f"cannot parse capture-order entry {item!r}: expected '<stage><kind><microbatch>' with kind in "
                "F, B, W, BW (e.g. '0F1', '1B0', '1W0')"
            )
        stage, microbatch = int(head), int(tail)
    else:
        try:
            stage, kind, microbatch = int(item.stage), str(item.kind), int(item.microbatch)  # type: ignore[attr-defined]
        except AttributeError:
            raise ValueError(
                f"capture-order entry {item!r} is neither a string like '0F1' nor an action with "
                "stage/kind/microbatch attributes"
            ) from None
        kind = kind.rsplit(".", 1)[-1]  # tolerate enum reprs such as 'ActionKind.F'
        if kind not in (*_KINDS, "BW"):
            raise ValueError(
                f"capture-order entry {item!r} has unknown kind {kind!r}; expected F, B, W or BW"
            )
    if stage < 0 or microbatch < 0:
        raise ValueError(f"capture-order entry {item!r}: stage and microbatch must be >= 0")
    if kind == "BW":
        return [GraphAction(stage, "B", microbatch), GraphAction(stage, "W", microbatch)]
    return [GraphAction(stage, kind, microbatch)]


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
