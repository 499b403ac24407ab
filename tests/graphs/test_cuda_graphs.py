"""The real CUDA backend: graphed results, gradients and hook fires equal eager ones on a GPU.

Skipped without CUDA (this suite's CI has none); run on a device machine with
``tests/graphs/run_device_checks.sh``, which also runs the eager-vs-graphed timing (``benchmarks/bench_graphs.py``)
— timings never live in tests. The CPU tests cover the logic through the stand-in; these check what only a GPU
can: capture on a side stream, a shared memory pool, replays of real ``torch.cuda.CUDAGraph`` objects.
"""

from __future__ import annotations

import pytest
import torch

import splitgrad
from splitgrad.graphs import CudaGraphBackend, make_graphed_callables
from splitgrad.graphs.backend import resolve_backend
from splitgrad.graphs.cuda_backend import CudaGraph
from splitgrad.testing import CpuGraphBackend

from .helpers import (
    assert_same_state,
    count_hooks,
    eager_step,
    give_main_grad,
    grad_state,
    graphed_step,
    loss_of,
    mlp,
    seeded,
)

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DEVICE = "cuda"


def _twins(*, delay: bool, fuse: bool, dtype: torch.dtype):
    eager = seeded(lambda: mlp(delay=delay, fuse=fuse, dtype=dtype)).to(DEVICE)
    model = seeded(lambda: mlp(delay=delay, fuse=fuse, dtype=dtype)).to(DEVICE)
    if fuse:
        for m in (eager, model):
            give_main_grad(m)
            for p in m.parameters():
                if hasattr(p, "main_grad"):
                    p.main_grad = p.main_grad.to(DEVICE)
    return eager, model


def _close(dtype: torch.dtype) -> dict[str, float]:
    # Same kernels, but cuBLAS may pick another algorithm under capture: tight, not bitwise.
    return {"rtol": 1e-12, "atol": 1e-12} if dtype == torch.float64 else {"rtol": 1e-5, "atol": 1e-6}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize(
    ("delay", "fuse"), [(True, False), (True, True), (False, True), (False, False)], ids=str
)
def test_cuda_graphed_matches_eager(delay: bool, fuse: bool, dtype: torch.dtype) -> None:
    eager, model = _twins(delay=delay, fuse=fuse, dtype=dtype)
    hooks_e, hooks_g = count_hooks(eager), count_hooks(model)
    sample = torch.randn(3, 6, device=DEVICE, dtype=dtype, requires_grad=True)
    graphed = make_graphed_callables(model, (sample,))
    assert isinstance(graphed.graphs["forward"], CudaGraph)
    assert graphed.need_backward_dw() is delay
    tol = _close(dtype)
    for step in range(4):
        if step == 2:
            for m in (eager, model):
                m.zero_grad(set_to_none=True)
        x = torch.randn(3, 6, device=DEVICE, dtype=dtype)
        xe, xg = x.clone().requires_grad_(), x.clone().requires_grad_()
        torch.testing.assert_close(graphed_step(graphed, xg), eager_step(eager, xe), **tol)
        torch.testing.assert_close(xg.grad, xe.grad, **tol)
        ge, gg = grad_state(eager), grad_state(model)
        assert ge.keys() == gg.keys()
        for key in ge:
            if isinstance(ge[key], torch.Tensor):
                torch.testing.assert_close(gg[key], ge[key], **tol, msg=key)
            else:
                assert gg[key] == ge[key], key
        assert hooks_g == hooks_e


def test_cuda_hooks_fire_once_per_wgrad_replay() -> None:
    _, model = _twins(delay=True, fuse=False, dtype=torch.float32)
    counts = count_hooks(model)
    graphed = make_graphed_callables(model, (torch.randn(3, 6, device=DEVICE),))
    for replay in range(1, 6):
        loss_of(graphed(torch.randn(3, 6, device=DEVICE))).backward()
        assert counts == {"0": replay - 1, "2": replay - 1}
        graphed.backward_dw()
        assert counts == {"0": replay, "2": replay}
    assert graphed.graphs["wgrad"].replays == 5


def test_cuda_pipeline_order_and_shared_pool() -> None:
    eager, model = _twins(delay=True, fuse=False, dtype=torch.float64)
    order = ["0F0", "0F1", "0B0", "0B1", "0W1", "0W0"]
    row = make_graphed_callables(
        (model,), ((torch.randn(3, 6, device=DEVICE, dtype=torch.float64),),), order=order
    )[0]
    xs = [torch.randn(3, 6, device=DEVICE, dtype=torch.float64) for _ in range(2)]
    bundles = []
    ys = [eager(x) for x in xs]
    for y in ys:
        with splitgrad.capture_wgrad() as bundle:
            loss_of(y).backward()
        bundles.append(bundle)
    for b in reversed(bundles):
        b.run()
    ys = [g(x) for g, x in zip(row, xs)]
    for y in ys:
        loss_of(y).backward()
    for g in reversed(row):
        g.backward_dw()
    ge, gg = grad_state(eager), grad_state(model)
    for key in ge:
        torch.testing.assert_close(gg[key], ge[key], **_close(torch.float64), msg=key)


def test_cuda_backend_is_picked_and_stand_in_still_works_on_cuda() -> None:
    model = seeded(mlp).to(DEVICE)
    sample = torch.randn(3, 6, device=DEVICE)
    assert isinstance(resolve_backend("auto", (sample,)), CudaGraphBackend)
    graphed = make_graphed_callables(model, (sample,), backend=CpuGraphBackend())
    twin = seeded(mlp).to(DEVICE)
    x = torch.randn(3, 6, device=DEVICE)
    torch.testing.assert_close(graphed_step(graphed, x), eager_step(twin, x), rtol=0, atol=0)
    assert_same_state(grad_state(model), grad_state(twin))
