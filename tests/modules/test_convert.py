"""splitgrad.convert turns any PyTorch model's nn.Linear layers into split ones without changing training.

Why: ``convert`` is how existing models adopt the split backward; it must keep parameter identity (so
optimizers and checkpoints keep working), leave layers it cannot safely split alone, and give the same
training steps as the unconverted model.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import splitgrad
from splitgrad.convert import convert


class Toy(nn.Module):
    """Linears at several depths, a shared one, and an attention whose out_proj is read, never called."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.body = nn.Sequential(
            nn.LayerNorm(16), nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 16, bias=False)
        )
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
        self.shared = nn.Linear(16, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(self.inp(x))
        h = h + self.attn(h, h, h, need_weights=False)[0]
        return self.head(self.shared(self.shared(h)))


def _train(model: nn.Module, steps: int, *, split: bool) -> list[torch.Tensor]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    gen = torch.Generator().manual_seed(5)
    losses = []
    for _ in range(steps):
        x = torch.randn(2, 3, 8, generator=gen, dtype=torch.float64)
        loss = model(x).square().mean()
        loss.backward()
        if split:
            assert splitgrad.pending_wgrad(model) > 0
            splitgrad.backward_dw(model)
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses


def _toy() -> Toy:
    torch.manual_seed(0)
    return Toy().double()


def test_converts_in_place_keeping_parameter_identity():
    model = _toy()
    params = dict(model.named_parameters())
    keys = list(model.state_dict())
    assert convert(model) is model
    assert dict(model.named_parameters()) == params
    assert list(model.state_dict()) == keys
    for name in ("inp", "body.1", "body.3", "shared", "head"):
        layer = model.get_submodule(name)
        assert type(layer) is splitgrad.Linear and layer.need_backward_dw(), name
        assert layer.weight.skip_backward_post_hook
    assert type(model.attn.out_proj) is not splitgrad.Linear  # a subclass, read directly by its parent
    assert not getattr(model.attn.out_proj.weight, "skip_backward_post_hook", False)
    assert len([m for _, m in splitgrad.split_modules(model)]) == 5  # the shared linear converted once


@pytest.mark.parametrize("delay", [True, False])
def test_training_steps_are_identical(delay):
    reference = _toy()
    model = convert(copy.deepcopy(reference), delay_wgrad_compute=delay)
    want = _train(reference, 3, split=False)
    got = _train(model, 3, split=delay)
    # Bitwise: splitgrad.Linear runs the same kernels as nn.Linear, deferred or not.
    torch.testing.assert_close(torch.stack(got), torch.stack(want), rtol=0, atol=0)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")


def test_optimizer_built_before_conversion_still_trains_the_model():
    model = _toy()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    before = model.head.weight.detach().clone()
    convert(model)
    model(torch.randn(2, 3, 8, dtype=torch.float64)).sum().backward()
    splitgrad.backward_dw(model)
    opt.step()
    assert not torch.equal(model.head.weight, before)


def test_skipping_backward_dw_is_caught():
    """Negative check: without backward_dw the converted model's weights have no gradient, and the guard fires."""
    model = convert(_toy())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    splitgrad.guard_optimizer(opt, model)
    model(torch.randn(2, 3, 8, dtype=torch.float64)).sum().backward()
    assert model.head.weight.grad is None and model.attn.in_proj_weight.grad is not None
    with pytest.raises(RuntimeError, match="pending"):
        opt.step()
    splitgrad.backward_dw(model)
    opt.step()


def test_fused_conversion_writes_main_grad():
    model = convert(nn.Sequential(nn.Linear(4, 3)), fuse_wgrad_accumulation=True, delay_wgrad_compute=False)
    layer = model[0]
    layer.weight.main_grad = torch.zeros(3, 4)
    model(torch.randn(5, 4)).sum().backward()
    assert (
        layer.weight.grad is None and layer.weight.main_grad.abs().sum() > 0 and layer.bias.grad is not None
    )


def test_root_linear_returns_a_new_module_sharing_parameters():
    linear = nn.Linear(4, 3)
    new = convert(linear)
    assert type(new) is splitgrad.Linear and new.weight is linear.weight and new.bias is linear.bias


def test_linear_with_hooks_is_refused_with_its_name():
    model = nn.Sequential(nn.Linear(4, 3))
    model[0].register_forward_hook(lambda *args: None)
    with pytest.raises(ValueError, match=r"'0' has \['forward'\] hooks"):
        convert(model)
