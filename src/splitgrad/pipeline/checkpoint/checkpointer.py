"""Save and restore a pipeline rank's training state with torch.distributed.checkpoint (DCP).

:class:`PipelineCheckpointer` is built once on every rank of the job (all pipeline and data-parallel ranks)
from the runtime, the whole model (for the global names, :mod:`.names`) and the optimizer. ``save`` writes the
rank's share of a checkpoint collectively (:mod:`.state`: parameters, optimizer state, RNG, step, the job's own
state), synchronously or with DCP's ``async_save`` (the state is copied to CPU memory, then written by a
background thread while training goes on); the group's first rank publishes it once every rank's files are written
(:mod:`.store`). ``load`` restores a checkpoint under any schedule and rank layout with the same partition.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import logging
import pickle
import secrets
import threading
import time
import warnings
from collections.abc import Iterator, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from ...core import ensure_no_pending_wgrad
from ...distributed.group_ref import GroupRef
from ...distributed.wait import bounded_wait
from .names import describe_partition, partition_of, stage_tensors
from .state import (
    apply_optimizer_state,
    apply_rng_state,
    decode,
    encode,
    optimizer_entries,
    optimizer_keys,
    rng_entries,
)
from .store import (
    checkpoint_path,
    latest_checkpoint,
    publish,
    remove_unpublished,
    temporary_path,
    verify_checkpoint,
)

if TYPE_CHECKING:
    from ..runtime import PipelineRuntime

__all__ = ["PipelineCheckpointer", "Restored", "SaveHandle"]

logger = logging.getLogger(__name__)


@dataclass(kw_only=True, slots=True)
class SaveHandle:
    """What :meth:`PipelineCheckpointer.save` returns."""

    step: int
    """The step saved."""
    path: Path
    """Where the checkpoint is published (once complete)."""
    blocking_s: float
    """Seconds ``save`` held the caller: the whole write when synchronous; with ``async_save``, the wait for
    the previous save, the agreement, and the copy of the state to CPU memory."""
    asynchronous: bool
    """Whether the files are still being written in the background (:meth:`PipelineCheckpointer.wait`)."""


@dataclass(kw_only=True, slots=True)
class Restored:
    """What :meth:`PipelineCheckpointer.load` restored."""

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


@dataclass(slots=True)
class _Pending:
    step: int
    temporary: Path
    final: Path
    future: Future | None = None
    error: BaseException | None = None
    finished: threading.Event = field(default_factory=threading.Event)


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
        self._tensors = stage_tensors(model, runtime.stages)
        self._names = {id(t): name for entries in self._tensors.values() for name, t in entries.items()}
        if optimizer is not None:
            optimizer_entries(optimizer, self._names)  # raises on a parameter outside the stages
        self._distributed = dist.is_available() and dist.is_initialized()
        self._owned = self._distributed and group is None
        if self._owned:
            group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout))
        self._group = GroupRef(group, owner="PipelineCheckpointer.group") if self._distributed else None
        self._rank = dist.get_rank() if self._distributed else 0
        # DCP's coordinator, the rank that writes .metadata last: it publishes, once every rank has written.
        self._coordinator = not self._distributed or dist.get_rank(self.group) == 0
        if self._distributed and dist.get_world_size(self.group) > 1:
            _require_numpy()
        self.partition, self.layout = self._gather_layout()
        self._pending: _Pending | None = None
        self._failed: str | None = None
        self._closed = False
        if self._coordinator:
            remove_unpublished(self.root)

    # -- public API ----------------------------------------------------------------------------------------

    @property
    def group(self) -> dist.ProcessGroup | None:
        """The group the ranks save over (None without torch.distributed)."""
        return None if self._group is None else self._group.get()

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
        digest = _digest(extra or {}) if self._distributed else 0
        nonce = secrets.randbits(60) if self._coordinator else 0
        agreed = self._max([step, -step, digest, -digest, nonce], f"agreeing on checkpoint step {step}")
        if agreed[0] != -agreed[1]:
            raise ValueError(
                f"PipelineCheckpointer.save: the ranks save different steps ({-agreed[1]} .. {agreed[0]})"
            )
        if agreed[2] != -agreed[3]:
            raise ValueError(
                f"PipelineCheckpointer.save: extra differs between ranks (keys here: {sorted(extra or {})}); "
                "it is saved once for all ranks: pass each rank's own state as rank_extra"
            )
        pending = _Pending(step, temporary_path(self.root, step, agreed[4]), checkpoint_path(self.root, step))
        state = self._state_dict(step, encoded, rank_extra or {})
        writer = dcp.FileSystemWriter(pending.temporary)
        with _quiet_single_process(self._distributed):
            if async_save:
                future = dcp.async_save(
                    state, storage_writer=writer, process_group=self.group, no_dist=not self._distributed
                )
                pending.future = getattr(future, "upload_completion", future)
                pending.future.add_done_callback(lambda f: self._written(pending, f.exception()))
            else:
                try:
                    dcp.save(
                        state, storage_writer=writer, process_group=self.group, no_dist=not self._distributed
                    )
                except Exception as exc:  # every rank reports it in wait(); none publishes
                    self._written(pending, exc)
                else:
                    self._written(pending, None)
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
        (failed,) = self._max([int(pending.error is not None)], f"confirming checkpoint step {pending.step}")
        if pending.error is not None:
            raise RuntimeError(
                f"PipelineCheckpointer: the checkpoint of step {pending.step} failed on this rank "
                f"({type(pending.error).__name__}: {pending.error}); {pending.final} was not published"
            ) from pending.error
        if failed:
            raise RuntimeError(
                f"PipelineCheckpointer: the checkpoint of step {pending.step} failed on another rank; "
                f"{pending.final} was not published"
            )
        return pending.final

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
        path = self._choose(path)
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
        state: dict[str, Any] = {}
        for entries in self._tensors.values():
            for name, tensor in entries.items():
                state[f"model.{name}"] = _checked(f"model.{name}", tensor.detach(), meta, path)
        if self.optimizer is not None:
            for key in optimizer_keys(self.optimizer, self._names, meta):
                state[key] = _empty_like_saved(meta[key])
        rng_keys = [k for k in meta if k.startswith(f"rng.rank{self._rank}.")]
        rng_restored = bool(restore_rng and same_layout and rng_keys)
        for key in rng_keys if rng_restored else ():
            state[key] = _empty_like_saved(meta[key])
        rank_keys = [k for k in meta if k.startswith(f"rank{self._rank}.")] if same_layout else []
        for key in [k for k in meta if k.startswith("extra.") or k == "step"] + rank_keys:
            state[key] = _empty_like_saved(meta[key])
        with _quiet_single_process(self._distributed):
            dcp.load(state, storage_reader=reader, process_group=self.group, no_dist=not self._distributed)
        if self.optimizer is not None:
            apply_optimizer_state(self.optimizer, self._names, state)
        if rng_restored:
            apply_rng_state(self._rank, self.runtime.device, state)
        elif restore_rng:
            logger.warning(
                "PipelineCheckpointer.load: %s was saved by another rank layout; generator states not restored",
                path,
            )
        extra = {k[len("extra.") :]: decode(v) for k, v in state.items() if k.startswith("extra.")}
        prefix = f"rank{self._rank}."
        rank_extra = {k[len(prefix) :]: decode(state[k]) for k in rank_keys} if same_layout else None
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
            if self._owned and self._group is not None:
                group = self._group.get()
                self._group = None
                dist.destroy_process_group(group)

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

    def _state_dict(
        self, step: int, extra: Mapping[str, torch.Tensor], rank_extra: Mapping[str, Any]
    ) -> dict[str, torch.Tensor]:
        state = {f"model.{n}": t.detach() for entries in self._tensors.values() for n, t in entries.items()}
        if self.optimizer is not None:
            state.update(optimizer_entries(self.optimizer, self._names))
        state.update(rng_entries(self._rank, self.runtime.device))
        state["step"] = torch.tensor(step, dtype=torch.int64)
        state.update(extra)
        state.update({f"rank{self._rank}.{k}": encode(v) for k, v in rank_extra.items()})
        return state

    def _written(self, pending: _Pending, error: BaseException | None) -> None:
        """Every rank's files are written (DCP's save returns only then): the coordinator publishes."""
        try:
            if error is None and self._coordinator:
                publish(pending.temporary, pending.final, self._marker(pending.step))
        except Exception as exc:
            error = exc
        finally:
            pending.error = error
            pending.finished.set()

    def _marker(self, step: int) -> dict[str, Any]:
        return {
            "step": step, "schedule": self.runtime.schedule.name, "partition": self.partition,
            "layout": self.layout, "torch": torch.__version__,
        }  # fmt: skip

    def _choose(self, path: str | Path | None) -> Path:
        if path is None:
            found = latest_checkpoint(self.root) if self._coordinator else None
            (step,) = self._max([-1 if found is None else _step_of(found)], "choosing the latest checkpoint")
            if step < 0:
                raise FileNotFoundError(
                    f"PipelineCheckpointer.load: no complete checkpoint under {self.root}"
                )
            return checkpoint_path(self.root, step)
        return Path(path)

    def _gather_layout(self) -> tuple[list[list[str]], list[list[Any]]]:
        """Every stage's pieces and every rank's stages (a collective over the group)."""
        mine = {
            "rank": self._rank,
            "stages": sorted(self._tensors),
            "partition": partition_of({s: list(e) for s, e in self._tensors.items()}),
        }
        gathered = [mine]
        if self._distributed:
            gathered = [None] * dist.get_world_size(self.group)
            dist.all_gather_object(gathered, mine, group=self.group)
        partition: dict[int, tuple[str, ...]] = {}
        for entry in gathered:
            for s, pieces in entry["partition"].items():
                if partition.setdefault(s, pieces) != pieces:
                    raise ValueError(
                        f"PipelineCheckpointer: ranks hold stage {s} as {partition[s]} and {pieces}; replicas of a "
                        "stage must be cut alike"
                    )
        n_stages = self.runtime.schedule.n_stages
        if sorted(partition) != list(range(n_stages)):
            raise ValueError(
                f"PipelineCheckpointer: the group's ranks hold stages {sorted(partition)} of {n_stages}; build it "
                "on every rank of the job"
            )
        layout = [[e["rank"], e["stages"]] for e in sorted(gathered, key=lambda e: e["rank"])]
        return [list(partition[s]) for s in range(n_stages)], layout

    def _max(self, values: list[int], what: str) -> list[int]:
        """Element-wise maximum over the group (the values themselves without torch.distributed)."""
        if not self._distributed:
            return values
        tensor = torch.tensor(values, dtype=torch.int64)
        work = dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        bounded_wait(work, f"PipelineCheckpointer: {what}", timeout=self.timeout, group=self.group)
        return tensor.tolist()


def _digest(extra: Mapping[str, Any]) -> int:
    """A 56-bit digest of ``extra``'s content, compared between ranks (tensors by dtype, shape and bytes: their
    pickled form carries a random serialization id)."""
    h = hashlib.blake2b(digest_size=7)

    def feed(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            value = value.detach().cpu().contiguous()
            h.update(f"tensor {value.dtype} {tuple(value.shape)}".encode())
            h.update(value.reshape(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(value, Mapping):
            for key in sorted(value, key=repr):
                h.update(repr(key).encode())
                feed(value[key])
        elif isinstance(value, (list, tuple)):
            h.update(f"{type(value).__name__} {len(value)}".encode())
            for item in value:
                feed(item)
        else:
            h.update(pickle.dumps(value))

    feed(dict(extra))
    return int.from_bytes(h.digest(), "little")


def _step_of(path: Path) -> int:
    return int(path.name.split("_", 1)[1])


def _checked(key: str, tensor: torch.Tensor, meta: Mapping[str, Any], path: Path) -> torch.Tensor:
    saved = meta.get(key)
    if saved is None:
        raise ValueError(f"PipelineCheckpointer.load: {path} has no {key!r} (is it the same model?)")
    if tuple(saved.size) != tuple(tensor.shape) or saved.properties.dtype != tensor.dtype:
        raise ValueError(
            f"PipelineCheckpointer.load: {key!r} is {tuple(tensor.shape)} {tensor.dtype} here but "
            f"{tuple(saved.size)} {saved.properties.dtype} in {path}"
        )
    return tensor


def _empty_like_saved(saved: Any) -> torch.Tensor:
    return torch.empty(tuple(saved.size), dtype=saved.properties.dtype)


@contextlib.contextmanager
def _quiet_single_process(distributed: bool) -> Iterator[None]:
    """DCP warns that it assumes a single process when torch.distributed is not initialised: here on purpose."""
    with warnings.catch_warnings():
        if not distributed:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _require_numpy() -> None:
    try:
        import numpy  # noqa: F401
    except ImportError:
        raise RuntimeError(
            "PipelineCheckpointer: torch.distributed.checkpoint exchanges its plans with object collectives, "
            "which need numpy; pip install numpy (or splitgrad[checkpoint])"
        ) from None
