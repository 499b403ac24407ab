"""``splitgrad.parallel.destroy_process_group`` frees a group that DTensor's caches would keep alive.

Why: torch 2.13's DTensor sharding-propagation caches keep every ``DeviceMesh`` a DTensor operation used, and a
mesh holds its process groups; after FSDP2 or DTensor work, ``torch.distributed.destroy_process_group()``
therefore leaves the default group, and its gloo worker threads, alive into interpreter shutdown, where gloo
can abort a finished rank (docs/parallel.md, "A crash at exit"; the FSDP2 doc block left 2 such threads per
rank). splitgrad's clears the caches and collects garbage first. Checked deterministically: a weak reference
to the destroyed group must die; the negative check shows the cache holding the mesh before. One-rank gloo
group in this process.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from splitgrad.parallel import destroy_process_group


def test_destroy_frees_a_group_dtensor_caches_hold(tmp_path):
    if dist.is_initialized():
        pytest.skip("a default process group already exists in this process")
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    x = distribute_tensor(torch.arange(4, dtype=torch.float64), mesh, [Shard(0)])
    total = (x * 2).sum().full_tensor()
    assert total.item() == 12.0  # the DTensor op ran
    mesh_ref, group_ref = weakref.ref(mesh), weakref.ref(dist.group.WORLD)
    del x, total, mesh
    gc.collect()
    # Negative check: with every script reference gone, torch's caches still hold the mesh, and the mesh its
    # group (what torch's destroy_process_group() leaves alive; not destroyed that way here, since the
    # leaked group's workers would then run into this process's own exit).
    cached = mesh_ref()
    assert cached is not None, "nothing held the mesh: the check below would prove nothing"
    assert any(g is group_ref() for g in vars(cached).get("_pg_registry", {}).values()) or not hasattr(
        cached, "_pg_registry"
    )
    del cached
    destroy_process_group()
    assert not dist.is_initialized()
    assert mesh_ref() is None and group_ref() is None, (
        "the group outlived splitgrad's destroy_process_group()"
    )
