"""Tensor-parallel layers and the GPT model never store the default process group.

Why: a reference to the default group that outlives ``destroy_process_group()`` keeps gloo's worker threads
running into interpreter shutdown, where a worker still releasing its last collective's tensors needs the GIL
and aborts the process ("terminate called without an active exception", SIGABRT; docs/parallel.md, "A crash
at exit"). ``tp_group=dist.group.WORLD`` is the usual spelling, so the layers look it up at use instead. A
group of their own is held, as it must be (the negative check). One-rank gloo group in this process.
"""

from __future__ import annotations

import gc

import pytest
import torch
import torch.distributed as dist

import splitgrad
from splitgrad.models import GPT, GPTConfig, lm_loss
from tests.helpers import one_rank_group


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    yield from one_rank_group(tmp_path_factory)


def _reaches(root: object, target: object) -> bool:
    """True when ``target`` is reachable from ``root`` through gc referents (tensors' data aside)."""
    seen, todo = set(), [root]
    while todo:
        obj = todo.pop()
        if obj is target:
            return True
        if id(obj) in seen or isinstance(obj, type):
            continue
        seen.add(id(obj))
        todo.extend(gc.get_referents(obj))
        if hasattr(obj, "__slots__") and not isinstance(obj, torch.Tensor):
            todo.extend(getattr(obj, name) for name in _slot_names(type(obj)) if hasattr(obj, name))
    return False


def _slot_names(cls: type) -> list[str]:
    return [name for klass in cls.__mro__ for name in getattr(klass, "__slots__", ())]


def _models(tp_group):
    tp = {"tp_group": tp_group, "delay_wgrad_compute": True}
    return [
        splitgrad.Linear(8, 8, parallel_mode="column", **tp),
        splitgrad.Linear(8, 8, parallel_mode="row", **tp),
        splitgrad.LayerNormLinear(8, 8, parallel_mode="column", **tp),
        splitgrad.LayerNormMLP(8, 16, **tp),
        GPT(
            GPTConfig(vocab_size=16, seq_len=4, hidden_size=8, num_heads=2, ffn_hidden_size=16, num_layers=1),
            tp_group=tp_group,
        ),
    ]


def test_the_default_group_is_looked_up_not_held(group):
    world = dist.group.WORLD
    for model in _models(world):
        assert not _reaches(model, world), type(model).__name__
    gpt = _models(world)[-1]
    assert gpt.tp_group is world  # still the group it was built with
    ids = torch.randint(0, 16, (2, 4), generator=torch.Generator().manual_seed(0))
    lm_loss(gpt(ids), ids).backward()
    splitgrad.backward_dw(gpt)
    assert not _reaches(gpt, world)
    assert all(p.grad is not None for p in gpt.parameters())


def test_a_group_of_their_own_is_held(group):
    own = dist.new_group([0])
    for model in _models(own):
        assert _reaches(model, own), type(model).__name__  # negative check: the search finds a held group
    assert _models(own)[-1].tp_group is own
