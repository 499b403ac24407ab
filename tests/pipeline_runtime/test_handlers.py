"""The runtime's dispatch: every action goes through the kind -> handler table with an explicit context.

Why: the runtime only interprets, so what a handler may touch is what its :class:`HandlerContext` holds, not
the runtime. Two things follow that a refactor could silently break: an entry replaced in ``runtime.handlers``
sees every action of its kind (the diagnostics in ``benchmarks/_schedstat.py`` rely on it), and the table and
the context hold no reference back to the runtime, so a dropped runtime is freed at once, with its hold on the
process groups, not at the next garbage collection.
"""

from __future__ import annotations

import gc
import weakref

import torch
import torch.nn.functional as F

from splitgrad.pipeline import ActionKind
from splitgrad.pipeline.runtime import build_runtime, sequential_stages
from splitgrad.pipeline.runtime.handlers import HandlerContext, default_handlers

from .workers import mlp_blocks


def _runtime(schedule: str = "zbv"):  # two stages on one rank: no process group needed
    stages = sequential_stages(mlp_blocks(delay=True), 2, sizes=[4, 3])
    return build_runtime(stages, schedule, n_microbatches=4, loss_fn=F.mse_loss)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return torch.randn(8, 12, generator=gen, dtype=torch.float64), torch.randn(
        8, 5, generator=gen, dtype=torch.float64
    )


def test_a_replaced_entry_sees_every_action_of_its_kind_with_the_context():
    rt = _runtime()
    seen = []
    weight = rt.handlers[ActionKind.W]

    def counting(ctx, action, received):
        seen.append((type(ctx), str(action)))
        weight(ctx, action, received)

    rt.handlers[ActionKind.W] = counting
    rt.step(*_batch())
    assert sorted(name for _, name in seen) == sorted(str(a) for a in rt.actions if a.kind is ActionKind.W)
    assert {kind for kind, _ in seen} == {HandlerContext}
    assert set(default_handlers()) == set(ActionKind)  # every kind has its handler


def _freed_without_collector(make) -> bool:
    """Whether the object ``make()`` returns is freed as soon as its last reference goes (no cycle)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        ref = weakref.ref(make())
        return ref() is None
    finally:
        if was_enabled:
            gc.enable()


def test_a_dropped_runtime_is_freed_at_once():
    def stepped():
        rt = _runtime()
        rt.step(*_batch())
        return rt

    assert _freed_without_collector(stepped)

    # Negative check: a handler table holding a bound method of the runtime is a cycle, and it is seen.
    def cyclic():
        rt = _runtime()
        rt.handlers[ActionKind.R] = lambda ctx, action, received, rt=rt: None
        return rt

    assert not _freed_without_collector(cyclic)
    gc.collect()
