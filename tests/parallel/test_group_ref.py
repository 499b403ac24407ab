"""splitgrad's objects never keep a process group alive past its destruction.

Why: a gloo group's worker threads are joined only when the group's last reference dies, and
``destroy_process_group()`` drops torch's references only. A group still held by a DDP wrapper, a pipeline
runtime, a ``PipelineGroups``, an expert-parallel layer or an all-to-all autograd node left in a script's
globals kept its workers running into interpreter shutdown, where gloo can abort a finished rank
(docs/parallel.md, "A crash at exit"; the torchrun doc blocks left 2-6 such threads per rank). Each holder
now looks the default group up at use and holds other registered groups weakly
(``splitgrad.distributed.group_ref``). Checked deterministically: after ``destroy_process_group(group)`` the
group object must be freed (a weak reference to it dies), and using it through its holder raises a clear
error. One-rank gloo groups in this process.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import splitgrad
from splitgrad.distributed.group_ref import GroupRef
from splitgrad.models import MoEConfig, lm_loss
from splitgrad.parallel import DistributedDataParallel
from splitgrad.parallel.expert import ExpertParallelMoEGPT
from splitgrad.pipeline import build_runtime, pipeline_groups
from tests.helpers import destroyed_group, one_rank_group


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    yield from one_rank_group(tmp_path_factory)


def _linear():
    return splitgrad.Linear(4, 2, delay_wgrad_compute=True, params_dtype=torch.float64)


def test_ddp_runtime_and_pipeline_groups_do_not_hold_a_destroyed_group(group):
    def make(own):
        ddp = DistributedDataParallel(_linear(), process_group=own)
        rt = build_runtime([torch.nn.Sequential(_linear())], "1f1b", n_microbatches=2, loss_fn=F.mse_loss)
        rt_own = build_runtime(
            [torch.nn.Sequential(_linear())], "1f1b", n_microbatches=2, loss_fn=F.mse_loss, pp_group=own
        )
        assert ddp.process_group is own and rt_own.pp_group is own  # in use before
        return [ddp, rt, rt_own]

    ref, (ddp, rt, rt_own) = destroyed_group(make)
    assert ref() is None, "a splitgrad object kept the destroyed group alive"
    with pytest.raises(RuntimeError, match=r"DistributedDataParallel\.process_group: its process group was"):
        _ = ddp.process_group
    with pytest.raises(RuntimeError, match=r"PipelineRuntime\.pp_group: its process group was destroyed"):
        _ = rt_own.pp_group
    assert rt.pp_group is None  # the default group: looked up, still alive

    groups = pipeline_groups(pp_size=1)
    ref = weakref.ref(groups.pp_group)
    assert ref() is not None and groups.dp_group is None
    dist.destroy_process_group(ref())
    gc.collect()
    assert ref() is None
    with pytest.raises(RuntimeError, match=r"PipelineGroups\.pp_group: its process group was destroyed"):
        _ = groups.pp_group


def test_expert_layers_and_all_to_all_nodes_do_not_hold_a_destroyed_group(group):
    config = MoEConfig(
        vocab_size=16, seq_len=4, hidden_size=8, num_heads=2, num_experts=2, params_dtype=torch.float64
    )
    ids = torch.randint(0, 16, (2, 4), generator=torch.Generator().manual_seed(0))

    def make(own):
        model = ExpertParallelMoEGPT(config, ep_group=own)
        logits = model(ids)  # the graph (its all-to-all nodes) stays alive through `logits`
        lm_loss(logits, ids).backward(retain_graph=True)
        return [model, logits]

    ref, (model, logits) = destroyed_group(make)
    assert logits.grad_fn is not None
    assert ref() is None, "the expert model or its autograd graph kept the destroyed group alive"
    layer = model.blocks[0].mlp
    for name in ("ep_group", "dp_group"):
        with pytest.raises(RuntimeError, match=rf"ExpertParallelMoEMLP\.{name}: its process group was"):
            getattr(layer, name)


def test_the_check_sees_a_held_group(group):
    # Negative checks: a strong reference keeps the group alive (what the checks above would then see), and
    # a group torch does not know (a bare backend) is held strongly, since nothing else would keep it.
    ref, held = destroyed_group(lambda own: [own])
    assert ref() is held[0]
    backend = dist.ProcessGroupGloo(dist.HashStore(), 0, 1)
    kept = GroupRef(backend, owner="test")
    backend_ref = weakref.ref(backend)
    del backend
    gc.collect()
    assert backend_ref() is not None and kept.get() is backend_ref()
    assert GroupRef(dist.group.WORLD, owner="test").get_or_none() is None
