"""Destroy process groups after dropping what torch itself still holds of them.

Why: a gloo group's worker threads are joined only when the group's last reference dies, and
``torch.distributed.destroy_process_group()`` drops nothing but torch's registry. torch 2.13's DTensor
sharding-propagation caches keep every ``DeviceMesh`` an FSDP2 / DTensor operation used, and a mesh holds its
process groups (``DeviceMesh._pg_registry``): after any DTensor work the default group outlives its
destruction, its workers run into interpreter shutdown, and gloo can abort a finished rank there
(docs/parallel.md, "A crash at exit"). Objects in reference cycles hold groups until the next collection.
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
        try:
            # Private in torch 2.13 (the caches have no public handle); Megatron-LM clears it the same way
            # at teardown (NVIDIA/Megatron-LM PR #7029). Clearing only costs recomputing cached specs.
            importlib.import_module("torch.distributed.tensor.debug")._clear_sharding_prop_cache()
        except (ImportError, AttributeError) as exc:
            logger.debug("DTensor sharding-propagation caches not cleared: %s", exc)
    gc.collect()
    dist.destroy_process_group(group)
