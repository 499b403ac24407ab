"""What :class:`~.checkpointer.PipelineCheckpointer` hands back: a save under way, and what a load restored."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["Restored", "SaveHandle"]


@dataclass(kw_only=True, slots=True)
class SaveHandle:
    """What :meth:`~.checkpointer.PipelineCheckpointer.save` returns."""

    step: int
    """The step saved."""
    path: Path
    """Where the checkpoint is published (once complete)."""
    blocking_s: float
    """Seconds ``save`` held the caller: the whole write when synchronous; with ``async_save``, the wait for
    the previous save, the agreement, and the copy of the state to CPU memory."""
    asynchronous: bool
    """Whether the files are still being written in the background (:meth:`~.checkpointer.PipelineCheckpointer.wait`)."""


@dataclass(kw_only=True, slots=True)
class Restored:
    """What :meth:`~.checkpointer.PipelineCheckpointer.load` restored."""

    step: int
    """The step the checkpoint was taken after: training resumes with step ``step + 1``."""
    path: Path
    """The checkpoint loaded."""
    extra: dict[str, Any]
    """The job's state passed to ``save(extra=...)``, the same on every rank (a global data position, a
    learning-rate schedule, ...)."""
    rank_extra: dict[str, Any] | None
    """This rank's own state passed to ``save(rank_extra=...)`` (a data-parallel replica's data position, ...);
    None under another rank layout, where it has no saved counterpart."""
    rng_restored: bool
    """Whether this rank's generators were set to the saved ones (only under the layout that saved them)."""
    saved_schedule: str
    """Name of the schedule that was running when it was saved."""
    same_layout: bool
    """Whether the ranks hold the same stages as when it was saved."""
