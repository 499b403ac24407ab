"""Tensor-parallel layers, the GPT model and ``TensorParallelGroups`` never hold their process group.

Why: a reference to a group that outlives ``destroy_process_group()`` keeps gloo's worker threads running into
interpreter shutdown, where a worker still releasing its last collective's tensors needs the GIL and aborts the
process ("terminate called without an active exception", SIGABRT; docs/parallel.md, "A crash at exit"). The
default group (``tp_group=dist.group.WORLD``, the usual spelling) is looked up at use; a group of their own
(``tensor_parallel_groups``) is held weakly, torch's registry keeping it until it is destroyed. Checked
deterministically by reachability and by a weak reference that must die with the group; the negative checks
show both see a strong holder. One-rank gloo groups in this process. (At exit, across processes:
``tests/parallel/test_teardown.py::test_no_gloo_worker_is_left_at_interpreter_exit``.)
"""

from __future__ import annotations

import gc
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist

import splitgrad
from splitgrad.models import GPT, GPTConfig, lm_loss
from splitgrad.parallel import TensorParallelGroups
from tests.helpers import destroyed_group, one_rank_group


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


@dataclass(frozen=True, slots=True)
class _StrongHolder:
    """What ``TensorParallelGroups`` was before: a slotted dataclass holding the group itself."""

    tp_group: dist.ProcessGroup


def _groups(tp_group) -> TensorParallelGroups:
    return TensorParallelGroups(tp_rank=0, tp_group=tp_group, outer_rank=0, outer_group=tp_group)


def test_a_group_of_their_own_is_held_weakly(group):
    def make(own):
        holders = [*_models(own), _groups(own)]
        for holder in holders:
            assert not _reaches(holder, own), type(holder).__name__
        # In use before: the layers' collectives get it, the model and the layout hand it out.
        assert all(m.tp.group is own for m in holders[:4]) and holders[4].tp_group is own
        assert holders[5].tp_group is own and holders[5].outer_group is own
        # Negative check: the search sees a group held in slots, as the layout held it before.
        assert _reaches(_StrongHolder(own), own)
        return holders

    ref, holders = destroyed_group(make)
    assert ref() is None, (
        "a tensor-parallel layer, GPT or TensorParallelGroups kept the destroyed group alive"
    )
    with pytest.raises(RuntimeError, match=r"Linear\(8, 8\)\.tp_group: its process group was destroyed"):
        _ = holders[0].tp.group
    with pytest.raises(
        RuntimeError, match=r"LayerNormMLP\(8, 16\)\.tp_group: its process group was destroyed"
    ):
        _ = holders[3].tp.group
    with pytest.raises(RuntimeError, match=r"GPT\.tp_group: its process group was destroyed"):
        _ = holders[4].tp_group
    for name in ("tp_group", "outer_group"):
        with pytest.raises(RuntimeError, match=rf"TensorParallelGroups\.{name}: its process group was"):
            getattr(holders[5], name)


def test_the_weak_reference_sees_a_strong_holder(group):
    # Negative check of the one above: a holder like the old layout keeps the destroyed group alive.
    ref, held = destroyed_group(_StrongHolder)
    assert ref() is held.tp_group
