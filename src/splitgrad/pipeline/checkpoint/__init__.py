"""Checkpoints of a pipeline run on torch.distributed.checkpoint: save, publish complete, resume exactly.

* :class:`PipelineCheckpointer` (:mod:`.checkpointer`): built on every rank from the runtime, the whole model
  and the optimizer; ``save(step, extra=..., async_save=...)``, ``load(path=None)``, ``wait()``, ``close()``.
  Its parts: :mod:`.collective` (what the ranks agree on), :mod:`.share` (one rank's entries, written and
  read back), :mod:`.pending` (a write under way, published once complete), :mod:`.results` (what ``save`` and
  ``load`` return: :class:`SaveHandle`, :class:`Restored`).
* :mod:`.names`: tensors keyed by the whole model's names, so a checkpoint loads under any schedule and rank
  layout with the same partition (``describe_partition``).
* :mod:`.state`: what is saved (parameters, optimizer state by parameter name, RNG per rank, step, extra).
* :mod:`.store`: ``root/step_{k:08d}`` folders, written under a temporary name and published by one rename
  with a marker; :func:`latest_checkpoint` and :func:`verify_checkpoint` only accept complete ones.
* :mod:`.order`: whether two schedules add each stage's microbatch gradients in the same order
  (:func:`same_gradient_order`), i.e. whether resuming under the other is bitwise the same run.
"""

from __future__ import annotations

from .checkpointer import PipelineCheckpointer
from .names import describe_partition
from .order import gradient_order, same_gradient_order
from .results import Restored, SaveHandle
from .store import (
    IncompleteCheckpointError,
    checkpoint_path,
    latest_checkpoint,
    list_checkpoints,
    verify_checkpoint,
)

__all__ = [
    "IncompleteCheckpointError",
    "PipelineCheckpointer",
    "Restored",
    "SaveHandle",
    "checkpoint_path",
    "describe_partition",
    "gradient_order",
    "latest_checkpoint",
    "list_checkpoints",
    "same_gradient_order",
    "verify_checkpoint",
]
