"""Capturing in a pipeline order: one set of graphs per (stage, microbatch), replayed as a schedule runs them.

Zero-bubble schedules keep several microbatches in flight and run each W long after its B. The graphs of
each (stage, microbatch) must therefore own their static buffers; the gradients after a whole schedule must
equal an eager run that parks each microbatch's wgrad in a ``capture_wgrad`` bundle and runs the bundles in
the same order. The order is validated before anything is captured.
"""

from __future__ import annotations

import pytest
import torch

import splitgrad
from splitgrad.graphs.order import GraphAction, normalize_order
from splitgrad.testing import CpuGraphBackend
from tests.helpers import make_graphed

from .helpers import assert_same_state, grad_state, loss_of, mlp, seeded

# One rank holding two chunks, two microbatches in flight, W deferred (a zero-bubble-like interleaving).
ORDER = ["0F0", "1F0", "0F1", "1F1", "1B0", "1W0", "0B0", "1B1", "0W0", "1W1", "0B1", "0W1"]


def _chunks(seed: int) -> list[torch.nn.Module]:
    return [seeded(mlp, seed=seed), seeded(lambda: _narrow_mlp(), seed=seed + 1)]


def _narrow_mlp() -> torch.nn.Module:
    model = mlp()
    model[0] = splitgrad.Linear(4, 10, delay_wgrad_compute=True)
    return model


def _run_schedule(order, forward, backward_dw, xs, around_backward=None) -> list[torch.Tensor]:
    """Interpret ``order`` with stage boundaries cut like a pipeline runtime; returns the input grads.

    ``forward(stage, mb, x)``, ``backward_dw(stage, mb)``; ``around_backward(stage, mb, run)`` wraps each B.
    """
    boundary: dict[int, torch.Tensor] = {}
    outputs: dict[tuple[int, int], torch.Tensor] = {}
    inputs: dict[tuple[int, int], torch.Tensor] = {}
    for text in order:
        stage, kind, mb = int(text[0]), text[1], int(text[2])
        if kind == "F":
            src = xs[mb] if stage == 0 else boundary[mb]
            inputs[(stage, mb)] = src.detach().requires_grad_()
            outputs[(stage, mb)] = forward(stage, mb, inputs[(stage, mb)])
            if stage == 0:
                boundary[mb] = outputs[(stage, mb)]
        elif kind == "B":

            def run(stage: int = stage, mb: int = mb) -> None:
                if stage == 1:
                    loss_of(outputs[(stage, mb)]).backward()
                else:
                    outputs[(stage, mb)].backward(inputs[(1, mb)].grad)

            run() if around_backward is None else around_backward(stage, mb, run)
        else:
            backward_dw(stage, mb)
    return [inputs[(0, m)].grad for m in range(len(xs))]


def test_pipeline_order_matches_eager_bundles() -> None:
    eager, model = _chunks(0), _chunks(0)
    samples = ((torch.randn(3, 6, requires_grad=True),), (torch.randn(3, 4, requires_grad=True),))
    graphed = make_graphed(tuple(model), samples, order=ORDER)
    assert [[g.microbatch for g in row] for row in graphed] == [[0, 1], [0, 1]]
    assert graphed[0][0].static_inputs[0] is not graphed[0][1].static_inputs[0]

    # Eager B steps park their wgrad in a bundle per (stage, microbatch), as a splitgrad runtime does.
    bundles: dict[tuple[int, int], splitgrad.WgradBundle] = {}

    def park(stage: int, mb: int, run) -> None:
        with splitgrad.capture_wgrad() as bundle:
            run()
        bundles[(stage, mb)] = bundle

    for _ in range(2):  # two training steps, gradients accumulating
        xs = [torch.randn(3, 6), torch.randn(3, 6)]
        dx_eager = _run_schedule(
            ORDER, lambda s, m, x: eager[s](x), lambda s, m: bundles.pop((s, m)).run(), xs, park
        )
        dx_graphed = _run_schedule(
            ORDER, lambda s, m, x: graphed[s][m](x), lambda s, m: graphed[s][m].backward_dw(), xs
        )
        for a, b in zip(dx_graphed, dx_eager):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        for e, m in zip(eager, model):
            assert_same_state(grad_state(m), grad_state(e))
    assert not bundles


def test_single_graph_per_stage_cannot_hold_two_microbatches() -> None:
    """Negative check: without ``order`` there is one set of buffers, and the schedule above is refused."""
    model = _chunks(0)
    samples = ((torch.randn(3, 6, requires_grad=True),), (torch.randn(3, 4, requires_grad=True),))
    single = make_graphed(tuple(model), samples)
    with pytest.raises(RuntimeError, match="backward of an older forward call"):
        _run_schedule(
            ORDER,
            lambda s, m, x: single[s](x),
            lambda s, m: single[s].backward_dw(),
            [
                torch.randn(3, 6),
                torch.randn(3, 6),
            ],
        )


def test_pipeline_actions_and_stage_ids() -> None:
    """Orders may be pipeline ``Action`` objects (or strings with ``BW``) naming arbitrary stage ids."""
    actions = pytest.importorskip("splitgrad.pipeline.ir.actions")
    model = seeded(mlp)
    order = [actions.parse_action(t) for t in ("2F0", "2F1", "2BW0", "2B1", "2W1")]
    (row,) = make_graphed((model,), ((torch.randn(3, 6),),), order=order, stages=(2,))
    assert [g.stage for g in row] == [2, 2]
    for g in row:
        loss_of(g(torch.randn(3, 6))).backward()
    for g in row:
        g.backward_dw()


@pytest.mark.parametrize(
    ("order", "defers", "match"),
    [
        (["0F0", "0B0"], [True], r"lacks 0W0"),
        (["0F0", "0B0", "0W0"], [False], r"defers no weight gradient"),
        (["0F0", "0F0"], [False], r"'0F0' twice"),
        (["0B0", "0F0"], [False], r"before the forward"),
        (["0F0", "0W0", "0B0"], [True], r"before the backward"),
        (["0F1", "0B1"], [False], r"lacks 0F0, 0B0"),
        (["3F0"], [False], r"names stage 3"),
        (["0X0"], [False], r"cannot parse"),
        (["F0"], [False], r"cannot parse"),
        ([], [False], r"empty"),
        ([object()], [False], r"neither a string"),
    ],
)
def test_order_validation(order: list, defers: list[bool], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        normalize_order(order, stages=[0], defers=defers)


def test_order_normalization() -> None:
    actions, n = normalize_order(["4F0", "4BW0", "7F0", "7B0"], stages=[7, 4], defers=[False, True])
    assert n == 1
    assert [str(a) for a in actions] == ["1F0", "1B0", "1W0", "0F0", "0B0"]
    assert str(GraphAction(1, "W", 3)) == "1W3"
    with pytest.raises(ValueError, match="distinct"):
        normalize_order(["0F0"], stages=[0, 0], defers=[False, False])


def test_replay_out_of_capture_order_is_caught_by_the_pool_emulation() -> None:
    """Negative check: wgrad of stage 1 captured *between* the two backward graphs but replayed after both
    (what an ordinary ``loss.backward(); backward_dw()`` step does) would, on a GPU with the shared pool, overwrite
    what stage 0's backward saved for its wgrad. The stand-in emulates that and the gradients come out NaN;
    the same replay against the default capture order (all B, then all W) is exact."""
    samples = ((torch.randn(3, 6, requires_grad=True),), (torch.randn(3, 4, requires_grad=True),))
    xs = [torch.randn(3, 6)]
    natural = ["0F0", "1F0", "1B0", "0B0", "1W0", "0W0"]

    def step(graphed) -> None:
        _run_schedule(natural, lambda s, m, x: graphed[s][m](x), lambda s, m: graphed[s][m].backward_dw(), xs)

    bad = _chunks(0)
    step(make_graphed(tuple(bad), samples, order=["0F0", "1F0", "1B0", "1W0", "0B0", "0W0"]))
    assert torch.isnan(bad[0][0].weight.grad).any()

    good, eager = _chunks(0), _chunks(0)
    step(make_graphed(tuple(good), samples, order=natural))
    bundles = {}

    def park(stage: int, mb: int, run) -> None:
        with splitgrad.capture_wgrad() as bundle:
            run()
        bundles[(stage, mb)] = bundle

    _run_schedule(natural, lambda s, m, x: eager[s](x), lambda s, m: bundles.pop((s, m)).run(), xs, park)
    for e, m in zip(eager, good):
        assert_same_state(grad_state(m), grad_state(e))

    # Without the emulation the bad order looks fine on CPU: the bug would only show up on a GPU.
    unchecked = _chunks(0)
    bad_order = ["0F0", "1F0", "1B0", "1W0", "0B0", "0W0"]
    step(make_graphed(tuple(unchecked), samples, order=bad_order, backend=CpuGraphBackend(shared_pool=False)))
    for e, m in zip(eager, unchecked):
        assert_same_state(grad_state(m), grad_state(e))
