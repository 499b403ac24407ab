"""Misuse of graphed callables must fail loudly, never give silently wrong or lost gradients.

A graph replays fixed memory, so anything that moves memory or skips a step (a second backward before the
wgrad replay, a stale forward, a rebound ``.grad``/``main_grad``, a switch flipped after capture) would corrupt
gradients without an error; each case here must raise with a message naming the problem. Capture-time
refusals (hooks, data-dependent code, untrackable layers) and the restoration of state after a failed
capture are covered too.
"""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

import splitgrad
from splitgrad.graphs import GraphCaptureError
from tests.helpers import make_graphed

from .helpers import give_main_grad, grad_state, graphed_step, loss_of, mlp, seeded


@pytest.fixture
def graphed_mlp():
    model = seeded(mlp)
    return model, make_graphed(model, (torch.randn(3, 6, requires_grad=True),), num_warmup_iters=1)


def test_second_backward_before_backward_dw(graphed_mlp) -> None:
    _, graphed = graphed_mlp
    loss_of(graphed(torch.randn(3, 6))).backward()
    with pytest.raises(RuntimeError, match="forward called while the wgrad"):
        graphed(torch.randn(3, 6))
    graphed.backward_dw()
    y1 = graphed(torch.randn(3, 6))
    loss_of(y1).backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward while the wgrad"):
        loss_of(y1).backward()
    graphed.backward_dw()


def test_backward_dw_without_pending_work(graphed_mlp) -> None:
    _, graphed = graphed_mlp
    with pytest.raises(RuntimeError, match="no pending weight-gradient work"):
        graphed.backward_dw()
    graphed_step(graphed, torch.randn(3, 6))
    with pytest.raises(RuntimeError, match="no pending weight-gradient work"):
        graphed.backward_dw()
    assert graphed.pending_wgrad == 0


def test_backward_dw_without_deferral() -> None:
    graphed = make_graphed(seeded(lambda: mlp(delay=False)), (torch.randn(3, 6),))
    assert not graphed.need_backward_dw() and graphed.get_backward_dw_params() == []
    loss_of(graphed(torch.randn(3, 6))).backward()
    with pytest.raises(RuntimeError, match="no captured layer defers"):
        graphed.backward_dw()


def test_stale_forward() -> None:
    graphed = make_graphed(seeded(lambda: mlp(delay=False)), (torch.randn(3, 6),))
    y1 = graphed(torch.randn(3, 6))
    graphed(torch.randn(3, 6))
    with pytest.raises(RuntimeError, match="backward of an older forward call"):
        loss_of(y1).backward()


def test_bad_call_arguments(graphed_mlp) -> None:
    _, graphed = graphed_mlp
    with pytest.raises(ValueError, match="expected 1 tensor argument"):
        graphed(torch.randn(3, 6), torch.randn(3, 6))
    with pytest.raises(ValueError, match=r"captured for \(3, 6\)"):
        graphed(torch.randn(4, 6))
    with pytest.raises(ValueError, match="float64"):
        graphed(torch.randn(3, 6, dtype=torch.float64))
    with pytest.raises(ValueError, match="must be a tensor"):
        graphed([1.0])


def test_input_requiring_grad_when_sample_did_not() -> None:
    graphed = make_graphed(seeded(mlp), (torch.randn(3, 6),))
    with pytest.raises(ValueError, match="sample arg did not"):
        graphed(torch.randn(3, 6, requires_grad=True))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_warmup_iters": 0}, "num_warmup_iters must be an int >= 1"),
        ({"sample_args": (torch.randn(3, 6), 2.0)}, "only tensors"),
        ({"sample_args": torch.randn(3, 6)}, "must be a tuple of tensors"),
        (
            {"callables": (nn.Identity(), nn.Identity()), "sample_args": ((torch.randn(1),),)},
            "one sample-args",
        ),
        ({"stages": (0, 1)}, "one stage per callable"),
        ({"backend": "tpu"}, "unknown graph backend"),
    ],
)
def test_bad_arguments(kwargs: dict, match: str) -> None:
    args = {"callables": seeded(mlp), "sample_args": (torch.randn(3, 6),), **kwargs}
    with pytest.raises(ValueError, match=match):
        make_graphed(args.pop("callables"), args.pop("sample_args"), **args)


def test_replaced_grad_is_refused_none_is_fine(graphed_mlp) -> None:
    model, graphed = graphed_mlp
    graphed_step(graphed, torch.randn(3, 6))
    model[0].weight.grad = None  # fine: the next write starts from zero, like eager
    graphed_step(graphed, torch.randn(3, 6))
    model[0].weight.grad = torch.zeros_like(model[0].weight)  # a different tensor: the graph cannot see it
    loss_of(graphed(torch.randn(3, 6))).backward()
    with pytest.raises(RuntimeError, match=r"`0.weight.grad` was replaced"):
        graphed.backward_dw()
    model[0].weight.grad = None
    graphed.backward_dw()


def test_replaced_main_grad_and_flipped_overwrite_are_refused() -> None:
    model = seeded(lambda: mlp(delay=True, fuse=True))
    give_main_grad(model)
    graphed = make_graphed(model, (torch.randn(3, 6),))
    w = model[2].weight
    loss_of(graphed(torch.randn(3, 6))).backward()
    old = w.main_grad
    w.main_grad = torch.zeros_like(old)
    with pytest.raises(RuntimeError, match=r"`2.weight.main_grad` was replaced"):
        graphed.backward_dw()
    w.main_grad = old
    w.overwrite_main_grad = True
    with pytest.raises(RuntimeError, match="overwrite_main_grad` changed after capture"):
        graphed.backward_dw()
    del w.overwrite_main_grad
    graphed.backward_dw()


def test_switches_flipped_after_capture(graphed_mlp) -> None:
    model, graphed = graphed_mlp
    model[2].set_delay_wgrad_compute(False)
    with pytest.raises(RuntimeError, match="delay_wgrad_compute of Linear changed after capture"):
        graphed(torch.randn(3, 6))
    model[2].set_delay_wgrad_compute(True)
    model.eval()
    with pytest.raises(RuntimeError, match="captured with training=True"):
        graphed(torch.randn(3, 6))
    model.train()
    model[3].weight.data = torch.zeros_like(model[3].weight)
    with pytest.raises(RuntimeError, match="re-allocated or moved after capture"):
        graphed(torch.randn(3, 6))


def test_frozen_after_capture() -> None:
    model = seeded(mlp)
    graphed = make_graphed(model, (torch.randn(3, 6),))
    model[0].bias.requires_grad_(False)
    with pytest.raises(RuntimeError, match="frozen"):
        graphed(torch.randn(3, 6))


def test_module_hooks_and_trainable_buffers_are_refused() -> None:
    model = seeded(mlp)
    handle = model[1].register_forward_hook(lambda *a: None)
    with pytest.raises(ValueError, match="module '1' has forward/backward hooks"):
        make_graphed(model, (torch.randn(3, 6),))
    handle.remove()
    model.register_buffer("scale", torch.ones(1, requires_grad=True))
    with pytest.raises(ValueError, match=r"buffers \['scale'\] require grad"):
        make_graphed(model, (torch.randn(3, 6),))


def test_layers_outside_the_callable_are_refused() -> None:
    layer = splitgrad.Linear(6, 4, delay_wgrad_compute=True)
    with pytest.raises(GraphCaptureError, match="neither inputs nor parameters of the callable"):
        make_graphed(lambda x: layer(x), (torch.randn(3, 6),))
    plain = nn.Linear(6, 6)  # a closed-over layer that does not defer: still never trained by the graphs
    with pytest.raises(GraphCaptureError, match=r"depend on 4 tensor\(s\)"):
        make_graphed(lambda x: layer(plain(x)), (torch.randn(3, 6, requires_grad=True),))
    assert layer.wgrad_store.captured == 0 and len(layer.wgrad_store) == 0


class _Item(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = splitgrad.Linear(6, 4, delay_wgrad_compute=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        return y * float(y.detach().abs().max())  # data-dependent: a host sync


def test_data_dependent_callable_is_refused_and_state_restored() -> None:
    module = _Item()
    module.lin.weight.grad = torch.ones_like(module.lin.weight)
    before = grad_state(module)
    counts = []
    module.lin.register_wgrad_accumulation_and_reduce_hooks(lambda: counts.append(1))
    with pytest.raises(GraphCaptureError, match=r"_Item\[0\]: capturing the forward graph failed"):
        make_graphed(module, (torch.randn(3, 6),), num_warmup_iters=1)
    after = grad_state(module)
    assert after.keys() == before.keys()
    assert module.lin.weight.grad is not None and torch.equal(
        after["lin.weight.grad"], before["lin.weight.grad"]
    )
    assert after["lin.bias.grad"] is None
    assert type(module.lin.wgrad_store.hooks).__name__ == "WgradHooks", "muted hooks must be restored"
    assert counts == []


def test_non_tensor_output_and_unused_input() -> None:
    class Pair(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 2)

        def forward(self, x: torch.Tensor, unused: torch.Tensor):
            return {"y": self.lin(x)}

    with pytest.raises(GraphCaptureError, match="must return a tensor or a non-empty tuple/list"):
        make_graphed(Pair(), (torch.randn(1, 2), torch.randn(1)))
    Pair.forward = lambda self, x, unused: self.lin(x)
    with pytest.raises(GraphCaptureError, match="input 1 requires grad but receives none"):
        make_graphed(Pair(), (torch.randn(1, 2), torch.randn(1, requires_grad=True)))
    graphed = make_graphed(
        Pair(), (torch.randn(1, 2), torch.randn(1, requires_grad=True)), allow_unused_input=True
    )
    graphed(torch.randn(1, 2), torch.randn(1, requires_grad=True)).sum().backward()


def test_autocast_cache_is_refused() -> None:
    with (
        torch.autocast("cpu", dtype=torch.bfloat16),
        pytest.raises(RuntimeError, match="needs cache_enabled=False"),
    ):
        make_graphed(seeded(mlp), (torch.randn(3, 6),))


def test_garbage_collected_with_pending_wgrad_warns() -> None:
    graphed = make_graphed(seeded(mlp), (torch.randn(3, 6),))
    loss_of(graphed(torch.randn(3, 6))).backward()
    with pytest.warns(RuntimeWarning, match="pending wgrad replay"):
        del graphed
        gc.collect()


class _FailingBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):  # type: ignore[override]
        return x.clone()

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        raise ValueError("backward exploded")


class _Explodes(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = splitgrad.Linear(6, 4, delay_wgrad_compute=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(_FailingBackward.apply(x))


def test_failed_warmup_leaves_no_owed_work(recwarn) -> None:
    module = _Explodes()
    with pytest.raises(ValueError, match="backward exploded"):
        make_graphed(module, (torch.randn(3, 6, requires_grad=True),))
    gc.collect()
    splitgrad.ensure_no_pending_wgrad(module)
    assert not [w for w in recwarn if "lost" in str(w.message)]
