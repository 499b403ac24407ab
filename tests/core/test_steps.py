"""A forward as steps (``splitgrad.core.steps``): the containers' ``forward_steps`` twins equal their plain forward.

Why: the single-thread overlap driver walks a model through ``forward_steps`` (GPT -> blocks -> MoE layers, or a
pipeline stage's blocks) while the plain ``forward`` keeps calling children through ``__call__``. The two paths
must compute the same thing, bitwise; a child with hooks must be called whole (its hooks fire); and a stepping
child's yields must reach the driver (else nothing interleaves). No processes: a stand-in MLP yields twice.
"""

from __future__ import annotations

import torch
from torch import nn

from splitgrad.core.steps import child_steps, has_steps, run_steps
from splitgrad.models import GPT, split_into_stages
from tests.models.helpers import batch, build, gpt_config


class SteppingMLP(nn.Module):
    """A stand-in MLP branch with steps: ``(..., hidden)`` -> same; yields twice (as a dispatch and a combine)."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.proj = nn.Linear(hidden, hidden, dtype=torch.float64)
        self.scale = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return run_steps(self.forward_steps(x))

    def forward_steps(self, x: torch.Tensor):
        y = self.proj(x)
        yield "dispatch"
        y = torch.tanh(y) * self.scale
        yield "combine"
        return y


def _stepping_gpt() -> GPT:
    model = build(GPT, gpt_config(num_layers=2))
    for block in model.blocks:
        block.mlp = SteppingMLP(model.config.hidden_size)
    return model


def test_forward_steps_twins_equal_plain_forward_bitwise():
    model = _stepping_gpt()
    ids, _ = batch(model.config, batch_size=2, seq=8)
    plain = model(ids)
    steps = model.forward_steps(ids)
    yielded = []
    while True:
        try:
            yielded.append(next(steps))
        except StopIteration as stop:
            stepped = stop.value
            break
    assert yielded == ["dispatch", "combine"] * 2  # the blocks' MLP steps reach the driver
    torch.testing.assert_close(stepped, plain, rtol=0, atol=0)
    for stage in split_into_stages(model, 2):
        x = ids if stage.is_first else torch.randn(2, 8, model.config.hidden_size, dtype=torch.float64)
        torch.testing.assert_close(run_steps(stage.forward_steps(x)), stage(x), rtol=0, atol=0)
    # Not trivially passing: a different MLP output is told apart.
    model.blocks[1].mlp.scale = 0.5
    assert not torch.equal(run_steps(model.forward_steps(ids)), plain)


def test_child_with_hooks_runs_whole_and_its_hooks_fire():
    model = _stepping_gpt()
    ids, _ = batch(model.config, batch_size=2, seq=8)
    fired = []
    handle = model.blocks[0].register_forward_pre_hook(lambda module, args: fired.append(module))
    assert not has_steps(model.blocks[0]) and has_steps(model.blocks[1])
    yielded = list(child_steps(model, ids))
    assert fired == [model.blocks[0]] and yielded == ["dispatch", "combine"]  # only block 1 was walked into
    handle.remove()
    assert has_steps(model.blocks[0])
    assert not has_steps(nn.Linear(2, 2))  # no forward_steps: called whole
