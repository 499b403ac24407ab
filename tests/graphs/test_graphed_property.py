"""Random interleavings of forward / backward / backward_dw across graphed layers give eager's gradients.

Each of two independently graphed layers runs its own F -> B -> W chain per step; hypothesis interleaves the
chains arbitrarily and sprinkles ``zero_grad`` (in place or to ``None``) between steps. Whatever the order,
the graphed gradients must equal an eager twin driven by the same sequence, bitwise.
"""

from __future__ import annotations

import functools

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import splitgrad
from tests.helpers import make_graphed

from .helpers import assert_same_state, give_main_grad, grad_state, loss_of, mlp, seeded


@functools.cache
def _setup():
    """Captured once per session (capture is the slow part); every example starts from zeroed grads."""
    builders = [lambda: mlp(delay=True), lambda: mlp(delay=True, fuse=True)]
    eager = [seeded(b, seed=i) for i, b in enumerate(builders)]
    model = [seeded(b, seed=i) for i, b in enumerate(builders)]
    for m in (eager[1], model[1]):
        give_main_grad(m)
    graphed = [make_graphed(m, (torch.randn(2, 6),), num_warmup_iters=1) for m in model]
    return eager, model, graphed


@st.composite
def schedules(draw):
    steps = [draw(st.integers(1, 3)) for _ in range(2)]
    chains = [[(layer, kind) for _ in range(n) for kind in "FBW"] for layer, n in enumerate(steps)]
    merged = []
    while any(chains):
        layer = draw(st.sampled_from([i for i, c in enumerate(chains) if c]))
        merged.append(chains[layer].pop(0))
        if draw(st.integers(0, 5)) == 0:
            merged.append((draw(st.integers(0, 1)), draw(st.sampled_from(["zero", "none"]))))
    return merged


def _drive(schedule, forward, backward_dw, models, xs) -> None:
    outputs: dict[int, torch.Tensor] = {}
    for i, (layer, kind) in enumerate(schedule):
        if kind == "F":
            outputs[layer] = forward(layer, xs[i % len(xs)])
        elif kind == "B":
            loss_of(outputs.pop(layer)).backward()
        elif kind == "W":
            backward_dw(layer)
        else:
            models[layer].zero_grad(set_to_none=kind == "none")
            for p in models[layer].parameters():
                if hasattr(p, "main_grad"):
                    p.main_grad.zero_()


@settings(max_examples=15, deadline=None)
@given(schedules())
def test_random_interleavings_match_eager(schedule) -> None:
    eager, model, graphed = _setup()
    for m in (*eager, *model):
        m.zero_grad(set_to_none=True)
        for p in m.parameters():
            if hasattr(p, "main_grad"):
                p.main_grad.zero_()
    xs = [torch.randn(2, 6) for _ in range(3)]
    _drive(schedule, lambda i, x: eager[i](x), lambda i: splitgrad.backward_dw(eager[i]), eager, xs)
    _drive(schedule, lambda i, x: graphed[i](x), lambda i: graphed[i].backward_dw(), model, xs)
    for e, m in zip(eager, model):
        assert_same_state(grad_state(m), grad_state(e))
