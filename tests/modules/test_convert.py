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


class KeepsForward(nn.Linear):
    """Like torchtitan's Linear: only the initialisation differs, forward is nn.Linear's."""

    def reset_parameters(self) -> None:
        nn.init.trunc_normal_(self.weight, std=0.02)
        if self.bias is not None:
            nn.init.zeros_(self.bias)


class OverridesForward(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * 2


class ReadsWeight(nn.Module):
    """A parent that uses its child's weight directly (the child's forward never runs)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.proj.weight.t()


def test_subclass_keeping_nn_linear_forward_is_converted_by_rule():
    model = nn.Sequential(KeepsForward(4, 3), nn.Linear(3, 2)).double()
    reference = copy.deepcopy(model)
    weight = model[0].weight
    convert(model)
    assert type(model[0]) is splitgrad.Linear and model[0].weight is weight
    x = torch.randn(5, 4, dtype=torch.float64)
    model(x).sum().backward()
    splitgrad.backward_dw(model)
    reference(x).sum().backward()
    torch.testing.assert_close(model[0].weight.grad, reference[0].weight.grad, rtol=0, atol=0)


def test_subclass_overriding_forward_is_refused_naming_it_unless_opted_in():
    model = nn.Sequential(nn.Linear(4, 4), OverridesForward(4, 3))
    with pytest.raises(ValueError, match=r"'1' \(.*OverridesForward\).*types=\[OverridesForward\]"):
        convert(model)
    assert type(model[0]) is nn.Linear  # nothing converted when it refuses
    convert(model, skip=["1"])
    assert type(model[0]) is splitgrad.Linear and type(model[1]) is OverridesForward
    model = convert(nn.Sequential(OverridesForward(4, 3)), types=[OverridesForward])
    assert type(model[0]) is splitgrad.Linear  # the caller vouched its forward is x @ W.T + b
    with pytest.raises(ValueError, match=r"types= takes nn\.Linear subclasses"):
        convert(nn.Sequential(nn.Linear(2, 2)), types=[nn.ReLU])


def test_linear_read_directly_by_its_parent_is_left_alone():
    model = nn.Sequential(ReadsWeight(), nn.Linear(4, 4))
    convert(model)
    assert type(model[0].proj) is nn.Linear and type(model[1]) is splitgrad.Linear
    assert not getattr(model[0].proj.weight, "skip_backward_post_hook", False)


def test_skip_leaves_a_whole_subtree_alone():
    model = _toy()
    convert(model, skip=["body"])
    assert type(model.body[1]) is nn.Linear and type(model.body[3]) is nn.Linear
    assert type(model.inp) is splitgrad.Linear
