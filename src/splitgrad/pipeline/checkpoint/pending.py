"""A save whose files are being written, and its publication once every rank has written them.

DCP's save returns (or its future completes, for ``async_save``) only after every rank's files and the
coordinator's ``.metadata`` are written; that moment, on the coordinator, is when the folder may be published
(:func:`.store.publish`). Whatever happens there is kept, so that every rank can report it at its next wait.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .collective import CheckpointGroup
from .store import publish

__all__ = ["PendingSave"]


@dataclass(slots=True)
class PendingSave:
    """The checkpoint of ``step``: written under ``temporary``, published as ``final``."""

    step: int
    temporary: Path
    final: Path
    future: Future | None = None
    """DCP's future of an asynchronous save (None for a synchronous one)."""
    error: BaseException | None = None
    """Why the write or the publication failed on this rank, once :attr:`finished`."""
    finished: threading.Event = field(default_factory=threading.Event)
    """Set once the files are written, and published where that is this rank's task (or failed)."""

    def written(self, error: BaseException | None, marker: Callable[[], dict[str, Any]] | None) -> None:
        """Every rank's files are written (DCP's save returns only then), or this rank's write failed.

        Args:
            error: the write's failure on this rank, or None.
            marker: on the coordinator, what the marker records (called now, when the files are complete);
                None on the other ranks, which do not publish.
        """
        try:
            if error is None and marker is not None:
                publish(self.temporary, self.final, marker())
        except Exception as exc:
            error = exc
        finally:
            self.error = error
            self.finished.set()

    def confirm(self, ranks: CheckpointGroup) -> Path:
        """Once :attr:`finished`, whether every rank wrote its files (a collective over ``ranks``).

        Returns:
            The published checkpoint.

        Raises:
            RuntimeError: it failed on this rank (chained to the cause) or on another one; not published.
        """
        (failed,) = ranks.max([int(self.error is not None)], f"confirming checkpoint step {self.step}")
        if self.error is not None:
            raise RuntimeError(
                f"PipelineCheckpointer: the checkpoint of step {self.step} failed on this rank "
                f"({type(self.error).__name__}: {self.error}); {self.final} was not published"
            ) from self.error
        if failed:
            raise RuntimeError(
                f"PipelineCheckpointer: the checkpoint of step {self.step} failed on another rank; "
                f"{self.final} was not published"
            )
        return self.final
