"""The CPU stand-in must behave like a CUDA graph, or the CPU tests of graph capture prove nothing.

Checked here on raw captures: replay re-runs only the recorded tensor work, into the same tensors (no
re-allocation, no Python), in-place accumulation accumulates again, and the strict checks refuse what would
corrupt memory on a GPU (data-dependent ops at capture; freed, re-allocated or re-shaped tensors at replay).
"""

from __future__ import annotations

import gc

import pytest
import torch

from splitgrad.graphs import GraphCaptureError, GraphReplayError
from splitgrad.graphs.backend import resolve_backend
from splitgrad.testing import CpuGraphBackend


def test_replay_recomputes_into_the_captured_output() -> None:
    backend = CpuGraphBackend()
    a, b = torch.randn(3, 4), torch.randn(4, 2)
    graph, out = backend.capture(lambda: torch.relu(a @ b) + 1)
    ptr = out.data_ptr()
    for _ in range(3):
        a.copy_(torch.randn(3, 4))
        graph.replay()
        torch.testing.assert_close(out, torch.relu(a @ b) + 1, rtol=0, atol=0)
        assert out.data_ptr() == ptr
    assert graph.replays == 3


def test_in_place_accumulation_accumulates_on_every_replay() -> None:
    acc = torch.zeros(2, 2)
    x, y = torch.randn(2, 3), torch.randn(3, 2)
    graph, _ = CpuGraphBackend().capture(lambda: acc.addmm_(x, y))
    expected = x @ y
    for n in range(2, 5):
        graph.replay()
        torch.testing.assert_close(acc, n * expected)


def test_views_alias_their_base_across_replays() -> None:
    x = torch.randn(4, 3)

    def fn() -> torch.Tensor:
        h = x * 2
        return h.t()[0]  # a view of an intermediate

    graph, view = CpuGraphBackend().capture(fn)
    x.fill_(1.5)
    graph.replay()
    torch.testing.assert_close(view, torch.full((4,), 3.0))


def test_python_code_does_not_run_on_replay() -> None:
    calls: list[int] = []
    x = torch.ones(2)

    def fn() -> torch.Tensor:
        calls.append(1)
        return x + len(calls)  # the Python int is baked into the graph

    graph, out = CpuGraphBackend().capture(fn)
    graph.replay()
    graph.replay()
    assert calls == [1]
    torch.testing.assert_close(out, torch.full((2,), 2.0))


def test_autograd_backward_is_recorded_below_autograd() -> None:
    w = torch.randn(3, 3, requires_grad=True)
    x = torch.randn(2, 3)
    y = (x @ w).tanh()
    gy = torch.zeros_like(y)
    graph, (gw,) = CpuGraphBackend().capture(lambda: torch.autograd.grad(y, (w,), gy))
    gy.copy_(torch.randn_like(gy))
    graph.replay()
    torch.testing.assert_close(gw, x.t() @ (gy * (1 - y.detach() ** 2)))


@pytest.mark.parametrize(
    "bad",
    [
        pytest.param(lambda t: t.sum().item(), id="item"),
        pytest.param(lambda t: t if t.sum() > 0 else -t, id="bool"),
        pytest.param(lambda t: t.nonzero(), id="nonzero"),
        pytest.param(lambda t: t[t > 0], id="mask-index"),
    ],
)
def test_data_dependent_ops_cannot_be_captured(bad) -> None:
    t = torch.randn(5)
    with pytest.raises(GraphCaptureError, match="depends on tensor data"):
        CpuGraphBackend().capture(lambda: bad(t))


def test_freed_external_tensor_is_refused() -> None:
    held = [torch.randn(3)]
    graph, _ = CpuGraphBackend().capture(lambda: held[0] * 2)
    held.clear()  # the only reference: its memory is freed
    gc.collect()
    with pytest.raises(GraphReplayError, match="freed after capture"):
        graph.replay()


def test_reallocated_or_resized_tensor_is_refused() -> None:
    p = torch.nn.Parameter(torch.randn(3))
    graph, _ = CpuGraphBackend().capture(lambda: p * 2)
    graph.replay()
    p.data = torch.randn(3)  # new memory behind the same object
    with pytest.raises(GraphReplayError, match="re-allocated or re-shaped"):
        graph.replay()
    q = torch.randn(4)
    graph, _ = CpuGraphBackend().capture(lambda: q + 1)
    q.resize_(2)
    with pytest.raises(GraphReplayError, match="re-allocated or re-shaped"):
        graph.replay()


def test_python_constants_are_owned_by_the_graph() -> None:
    x = torch.randn(3)
    graph, out = CpuGraphBackend().capture(lambda: x * torch.tensor(3.0))
    gc.collect()
    graph.replay()  # the temporary torch.tensor(3.0) is kept, as a CUDA kernel keeps a baked-in scalar
    torch.testing.assert_close(out, x * 3)


def test_in_place_write_of_the_wrong_buffer_is_visible() -> None:
    """Negative check: a graph writes the tensor it captured; rebinding a name afterwards does not redirect it."""
    grad = torch.zeros(2)
    holder = {"grad": grad}
    graph, _ = CpuGraphBackend().capture(lambda: holder["grad"].add_(1))
    holder["grad"] = torch.zeros(2)  # what `param.grad = new_tensor` does to a captured graph
    graph.replay()
    assert torch.equal(holder["grad"], torch.zeros(2)) and torch.equal(grad, torch.full((2,), 2.0))


def test_resolve_backend() -> None:
    # "auto" on CPU tensors refuses: the emulator is a test double, slower than eager, never picked for users.
    with pytest.raises(ValueError, match="call the layers eagerly"):
        resolve_backend("auto", ((torch.zeros(1),),))
    with pytest.raises(ValueError, match=r"unknown graph backend 'cpu'.*splitgrad.testing.CpuGraphBackend"):
        resolve_backend("cpu", ((torch.zeros(1),),))
    backend = CpuGraphBackend()
    assert resolve_backend(backend, ()) is backend
    with pytest.raises(ValueError, match="unknown graph backend"):
        resolve_backend("tpu", ())
    with pytest.raises(ValueError, match="needs CUDA sample tensors"):
        resolve_backend("cuda", ((torch.zeros(1),),))
    with pytest.raises(ValueError, match="GraphBackend"):
        resolve_backend(object(), ())  # type: ignore[arg-type]
