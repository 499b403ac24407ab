"""Save and restore a pipeline rank's training state with torch.distributed.checkpoint (DCP): the order of it.

:class:`PipelineCheckpointer` is built once on every rank of the job (all pipeline and data-parallel ranks)
from the runtime, the whole model (for the global names, :mod:`.names`) and the optimizer. ``save`` writes the
rank's share of a checkpoint collectively (:mod:`.share`, :mod:`.state`: parameters, optimizer state, RNG, step,
the job's own state), synchronously or with DCP's ``async_save`` (the state is copied to CPU memory, then written
by a background thread while training goes on); the group's first rank publishes it once every rank's files are
written (:mod:`.pending`, :mod:`.store`). ``load`` restores a checkpoint under any schedule and rank layout with
the same partition. What the ranks must agree on is decided over the group in :mod:`.collective`; this module
only orders those steps and calls DCP.
"""

from __future__ import annotations

import contextlib
import logging
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from ...core import ensure_no_pending_wgrad
from .collective import CheckpointGroup
from .names import describe_partition
from .pending import PendingSave
from .results import Restored, SaveHandle
from .share import RankShare, decode_extras
from .state import encode
from .store import (
    checkpoint_path,
    latest_checkpoint,
    remove_unpublished,
    temporary_path,
    verify_checkpoint,
)

if TYPE_CHECKING:
    from ..runtime import PipelineRuntime

__all__ = ["PipelineCheckpointer"]

logger = logging.getLogger(__name__)


class PipelineCheckpointer:
    """Checkpoints of one rank's stages, optimizer, RNG and step under ``root``, keyed by global names.

    Every rank of the job builds one, at the same point (a collective), and calls :meth:`save`,
    :meth:`wait`, :meth:`load` and :meth:`close` at the same points. ``root`` must be one folder every rank
    sees (a shared filesystem across machines).

    Args:
        root: the checkpoints folder (``root/step_{k:08d}``); leftovers of writers that died are removed here.
        runtime: this rank's :class:`~splitgrad.pipeline.PipelineRuntime`.
        model: the whole model the stages were cut from (names only: every tensor of a stage must be one of
            its tensors).
        optimizer: this rank's optimizer (over the runtime's parameters), or None to save the model only.
        group: the ranks that save together (every rank of the job); None: a new gloo group over the default
            group, made here and destroyed by :meth:`close`. Asynchronous saves run collectives on it from a
            background thread, so pass a group nothing else uses (gloo, as DCP's async save needs a CPU one).
        timeout: seconds any collective of a save or load may take (and a wait for a background write)
            before a ``RuntimeError`` naming it.

    Raises:
        RuntimeError: several ranks without numpy (DCP's object collectives need it).
        ValueError: a stage tensor that ``model`` does not hold, or an optimizer parameter not in the stages.
    """

    def __init__(
        self,
        root: str | Path,
        runtime: PipelineRuntime,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        group: dist.ProcessGroup | None = None,
        timeout: float = 600.0,
    ) -> None:
        if not timeout > 0:
            raise ValueError(f"PipelineCheckpointer: timeout must be positive seconds, got {timeout=}")
        self.root = Path(root)
        self.runtime, self.optimizer, self.timeout = runtime, optimizer, float(timeout)
        # Before the group: a wrong model or optimizer raises before any group is made or collective joined.
        self._share = RankShare(model, runtime.stages, optimizer)
        self._ranks = CheckpointGroup(group, timeout=self.timeout)
        self._distributed, self._rank = self._ranks.distributed, self._ranks.rank
        self._coordinator = self._ranks.coordinator
        self.partition, self.layout = self._ranks.gather_layout(
            self._share.tensors, runtime.schedule.n_stages
        )
        self._pending: PendingSave | None = None
        self._failed: str | None = None
        self._closed = False
        if self._coordinator:
            remove_unpublished(self.root)

    # -- public API ----------------------------------------------------------------------------------------

    @property
    def group(self) -> dist.ProcessGroup | None:
        """The group the ranks save over (None without torch.distributed)."""
        return self._ranks.group

    def latest(self) -> Path | None:
        """The newest complete checkpoint under ``root`` (this rank's view), or None."""
        return latest_checkpoint(self.root)

    def save(
        self,
        step: int,
        *,
        extra: Mapping[str, Any] | None = None,
        rank_extra: Mapping[str, Any] | None = None,
        async_save: bool = False,
    ) -> SaveHandle:
        """Checkpoint the state after ``step`` optimizer steps into ``root/step_{step:08d}`` (every rank).

        Args:
            step: optimizer steps taken so far (the same on every rank).
            extra: the job's state, the same on every rank (checked), e.g. ``{"data": {"batches": 12,
                "generator": gen.get_state()}}`` (picklable values); :attr:`Restored.extra`.
            rank_extra: this rank's own state (e.g. its data-parallel replica's data position): restored
                under the same rank layout only (:attr:`Restored.rank_extra`).
            async_save: return once the state is copied to CPU memory; the files are written in the
                background and published when complete. A later ``save``, ``load``, :meth:`wait` or
                :meth:`close` waits for it first.

        Raises:
            RuntimeError: weight-gradient work is still owed by a stage (naming the modules and counts), a
                previous save failed, or this save failed on some rank.
            ValueError: the ranks passed different steps, or different ``extra``.
        """
        self._check_usable("save")
        start = time.perf_counter()
        self.wait()
        self._refuse_pending_wgrad("PipelineCheckpointer.save")
        encoded = {f"extra.{k}": encode(v) for k, v in (extra or {}).items()}
        nonce = self._ranks.agree_on_save(step, extra or {})
        pending = PendingSave(step, temporary_path(self.root, step, nonce), checkpoint_path(self.root, step))
        state = self._share.state_dict(
            step, encoded, rank_extra or {}, rank=self._rank, device=self.runtime.device
        )
        writer = dcp.FileSystemWriter(pending.temporary)
        with _quiet_single_process(self._distributed):
            if async_save:
                future = dcp.async_save(
                    state, storage_writer=writer, process_group=self.group, no_dist=not self._distributed
                )
                pending.future = getattr(future, "upload_completion", future)
                pending.future.add_done_callback(
                    lambda f: pending.written(f.exception(), self._publishing(pending))
                )
            else:
                try:
                    dcp.save(
                        state, storage_writer=writer, process_group=self.group, no_dist=not self._distributed
                    )
                except Exception as exc:  # every rank reports it in wait(); none publishes
                    pending.written(exc, self._publishing(pending))
                else:
                    pending.written(None, self._publishing(pending))
        self._pending = pending
        blocking = time.perf_counter() - start
        if not async_save:
            self.wait()
            blocking = time.perf_counter() - start
        return SaveHandle(step=step, path=pending.final, blocking_s=blocking, asynchronous=async_save)

    def wait(self) -> Path | None:
        """Finish the save under way, if any (every rank): wait for its files and for the first rank to publish them.

        Returns:
            The published checkpoint, or None when no save was under way.

        Raises:
            RuntimeError: it failed (on this rank: chained to the cause) or was not published.
        """
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        if not pending.finished.wait(self.timeout):
            self._failed = f"the write of step {pending.step} did not finish within {self.timeout:g} s"
            raise RuntimeError(f"PipelineCheckpointer: {self._failed} ({pending.temporary})")
        return pending.confirm(self._ranks)

    def load(self, path: str | Path | None = None, *, restore_rng: bool = True) -> Restored:
        """Restore a complete checkpoint into this rank's stages and optimizer (every rank).

        Args:
            path: the checkpoint folder; None: the newest complete one under ``root`` (the first rank chooses).
            restore_rng: set this rank's generators to the saved ones (done only when the ranks hold the same
                stages as when saved: under another layout a rank's stream has no saved counterpart).

        Raises:
            FileNotFoundError: no complete checkpoint under ``root`` (``path`` None), or ``path`` is missing.
            splitgrad.pipeline.checkpoint.IncompleteCheckpointError: ``path`` was never published complete.
            ValueError: the checkpoint's partition differs from this model's (naming both), or a tensor's shape
                or dtype differs.
            RuntimeError: weight-gradient work is still owed by a stage.
        """
        self._check_usable("load")
        self.wait()
        self._refuse_pending_wgrad("PipelineCheckpointer.load")
        path = self._ranks.choose_latest(self.root) if path is None else Path(path)
        marker = verify_checkpoint(path)
        saved = [list(p) for p in marker["partition"]]
        if saved != [list(p) for p in self.partition]:
            raise ValueError(
                f"PipelineCheckpointer.load: {path} holds a model cut into {len(saved)} stages as "
                f"[{describe_partition(saved)}], but this model is cut into {len(self.partition)} as "
                f"[{describe_partition(self.partition)}]; a checkpoint loads under another schedule or rank "
                "layout only with the same partition"
            )
        same_layout = marker["layout"] == self.layout
        reader = dcp.FileSystemReader(path)
        meta = reader.read_metadata().state_dict_metadata
        rng, rank = restore_rng and same_layout, self._rank
        state = self._share.read_buffers(meta, path, rank=rank, rng=rng, own=same_layout)
        with _quiet_single_process(self._distributed):
            dcp.load(state, storage_reader=reader, process_group=self.group, no_dist=not self._distributed)
        rng_restored = self._share.restore(state, rank=rank, device=self.runtime.device)
        if not rng_restored and restore_rng:
            logger.warning(
                "PipelineCheckpointer.load: %s was saved by another rank layout; generator states not restored",
                path,
            )
        extra, rank_extra = decode_extras(state, rank=rank, own=same_layout)
        step = int(state["step"])
        logger.info("restored %s (step %d, schedule %s)", path, step, marker["schedule"])
        return Restored(
            step=step, path=path, extra=extra, rank_extra=rank_extra, rng_restored=rng_restored,
            saved_schedule=marker["schedule"], same_layout=same_layout,
        )  # fmt: skip

    def close(self) -> None:
        """Wait for a save under way and release the group made here (every rank). Idempotent."""
        if self._closed:
            return
        try:
            if self._failed is None:
                self.wait()
        finally:
            self._closed = True
            self._ranks.close()

    def __enter__(self) -> PipelineCheckpointer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- internals ------------------------------------------------------------------------------------------

    def _check_usable(self, what: str) -> None:
        if self._closed:
            raise RuntimeError(f"PipelineCheckpointer.{what}() after close()")
        if self._failed is not None:
            raise RuntimeError(f"PipelineCheckpointer.{what}(): a previous save failed ({self._failed})")

    def _refuse_pending_wgrad(self, where: str) -> None:
        for s, module in self.runtime.stages.items():
            ensure_no_pending_wgrad(module, what=f"{where} (stage {s})")

    def _publishing(self, pending: PendingSave) -> Callable[[], dict[str, Any]] | None:
        """What the coordinator's marker of ``pending`` records (None elsewhere: one rank publishes)."""
        return (lambda: self._marker(pending.step)) if self._coordinator else None

    def _marker(self, step: int) -> dict[str, Any]:
        return {
            "step": step, "schedule": self.runtime.schedule.name, "partition": self.partition,
            "layout": self.layout, "torch": torch.__version__,
        }  # fmt: skip


@contextlib.contextmanager
def _quiet_single_process(distributed: bool) -> Iterator[None]:
    """DCP warns that it assumes a single process when torch.distributed is not initialised: here on purpose."""
    with warnings.catch_warnings():
        if not distributed:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield
