"""Issue 11 item 14: torch DDP / FSDP2 around layers that write their own weight gradient fail loudly.

Why: torch's DDP reducer and FSDP2's reduce-scatter only see gradients autograd accumulates, so wrapping
delayed (or fused) splitgrad layers in them silently gave unreduced gradients. Where it can be detected —
torch DDP's forward, a sharded DTensor parameter reaching ``backward_dw`` — it now raises naming the
supported path (``splitgrad.parallel.DistributedDataParallel``). One process, a one-rank gloo group.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import splitgrad


@pytest.fixture
def one_rank_group(tmp_path):
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_torch_ddp_around_a_delayed_layer_is_refused(one_rank_group):
    layer = splitgrad.Linear(4, 3, delay_wgrad_compute=True)
    ddp = torch.nn.parallel.DistributedDataParallel(layer)
    with pytest.raises(RuntimeError, match=r"splitgrad\.parallel\.DistributedDataParallel"):
        ddp(torch.randn(2, 4))
    # Immediate mode is what torch DDP supports: it trains as nn.Linear would.
    plain = torch.nn.parallel.DistributedDataParallel(splitgrad.Linear(4, 3))
    plain(torch.randn(2, 4)).sum().backward()
    assert plain.module.weight.grad is not None


def test_fsdp2_sharded_parameter_reaching_backward_dw_is_refused(one_rank_group):
    fully_shard = pytest.importorskip("torch.distributed.fsdp").fully_shard
    from torch.distributed.tensor import DTensor

    model = torch.nn.Sequential(splitgrad.Linear(4, 3, delay_wgrad_compute=True))
    fully_shard(model)
    assert isinstance(model[0].weight, DTensor)
    model(torch.randn(2, 4)).sum().backward()
    assert splitgrad.pending_wgrad(model) == 1
    with pytest.raises(
        RuntimeError, match=r"DTensor.*defer_fsdp_reduction.*splitgrad\.parallel\.DistributedDataParallel"
    ):
        splitgrad.backward_dw(model)
    assert splitgrad.pending_wgrad(model) == 1  # refused, not lost
    assert splitgrad.discard_wgrad(model) == 1
