"""Destroy process groups after dropping what torch itself still holds of them.

Why: a gloo group's worker threads are joined only when the group's last reference dies, and
``torch.distributed.destroy_process_group()`` drops nothing but torch's registry. torch 2.13's DTensor
sharding-propagation caches keep every ``DeviceMesh`` an FSDP2 / DTensor operation used, and a mesh holds its
process groups (``DeviceMesh._pg_registry``): after any DTensor work the default group outlives its
destruction, its workers run into interpreter shutdown, and gloo can abort a finished rank there
(docs/parallel.md, "A crash at exit"). Its other memoization caches (redistribute plans, mesh topology) keep
meshes too. Objects in reference cycles hold groups until the next collection.
"""

from __future__ import annotations

import gc
import importlib
import logging
import sys

import torch.distributed as dist

__all__ = ["destroy_process_group"]

logger = logging.getLogger(__name__)


def destroy_process_group(group: dist.ProcessGroup | None = None) -> None:
    """``torch.distributed.destroy_process_group(group)``, once nothing but the script holds the groups.

    Clears DTensor's sharding-propagation caches (when DTensor was used) and collects reference cycles first,
    so that destroying the group frees it and joins its gloo workers. The script's own references (a group in
    a variable, a model whose FSDP2 state holds a mesh) are the script's to drop before calling.

    Args:
        group: the group to destroy; None: every group (as torch's).
    """
    if "torch.distributed.tensor" in sys.modules:  # no DTensor was ever built otherwise
        _clear_dtensor_caches()
    gc.collect()
    dist.destroy_process_group(group)


def _clear_dtensor_caches() -> None:
    """Empty DTensor's memoization caches (sharding propagation, redistribute plans, mesh topology): they keep
    the ``DTensorSpec``s and ``DeviceMesh``es they were called with. Only costs recomputing cached results."""
    try:
        # Private in torch 2.13 (the caches have no public handle); Megatron-LM clears it the same way at
        # teardown (NVIDIA/Megatron-LM PR #7029). It also empties the C++ fast-path cache.
        importlib.import_module("torch.distributed.tensor.debug")._clear_sharding_prop_cache()
    except (ImportError, AttributeError) as exc:
        logger.debug("DTensor sharding-propagation caches not cleared: %s", exc)
    # Redistribute planners, keyed by a weak reference to their mesh but holding it strongly.
    redistribute = sys.modules.get("torch.distributed.tensor._redistribute")
    clear_planners = getattr(redistribute, "clear_redistribute_planner_cache", None)
    if callable(clear_planners):
        clear_planners()
    # The functools caches elsewhere in the package (`_gen_transform_infos`, `MeshTopoInfo.build_from_mesh`,
    # ...), found rather than named, so a torch that adds or renames one is covered too.
    modules = [
        m for name, m in list(sys.modules.items()) if name.startswith("torch.distributed.tensor") and m
    ]
    for module in modules:
        for obj in list(vars(module).values()):
            found = [obj]
            if isinstance(obj, type) and obj.__module__ == module.__name__:
                found += [getattr(v, "__func__", v) for v in vars(obj).values()]
            for fn in found:
                # Looked up on the type: an instance's __getattr__ (torch.ops namespaces) must not run.
                kind = type(fn)
                if (
                    not isinstance(fn, type)
                    and callable(getattr(kind, "cache_clear", None))
                    and hasattr(kind, "cache_info")
                ):
                    fn.cache_clear()
