"""The ranks that checkpoint together, and what they agree on before they write or read.

Every rank of the job takes part in a checkpoint, so each decision one rank could get wrong alone is made over
the whole group: the stages every rank holds (the partition and the rank layout a checkpoint records), the
step and the job's ``extra`` a save writes (compared by digest), the temporary folder's nonce (the first rank's),
and the checkpoint a load chooses. Without torch.distributed the one process is the whole group.
"""

from __future__ import annotations

import datetime
import hashlib
import pickle
import secrets
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ...distributed.group_ref import GroupRef
from ...distributed.wait import bounded_wait
from .names import partition_of
from .store import checkpoint_path, latest_checkpoint

__all__ = ["CheckpointGroup", "digest"]


class CheckpointGroup:
    """The group a checkpointer's ranks save over, and the collectives they agree with.

    Args:
        group: the ranks that save together; None: a new gloo group over the default group, made here and
            destroyed by :meth:`close`.
        timeout: seconds any collective may take before a ``RuntimeError`` naming it.

    Raises:
        RuntimeError: several ranks without numpy (DCP's object collectives need it).
    """

    def __init__(self, group: dist.ProcessGroup | None, *, timeout: float) -> None:
        self.timeout = timeout
        self.distributed = dist.is_available() and dist.is_initialized()
        self._owned = self.distributed and group is None
        if self._owned:
            group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout))
        self._group = GroupRef(group, owner="PipelineCheckpointer.group") if self.distributed else None
        self.rank = dist.get_rank() if self.distributed else 0
        """This process's rank in the default group (the one its RNG and ``rank_extra`` are saved under)."""
        # DCP's coordinator, the rank that writes .metadata last: it publishes, once every rank has written.
        self.coordinator = not self.distributed or dist.get_rank(self.group) == 0
        if self.distributed and dist.get_world_size(self.group) > 1:
            _require_numpy()

    @property
    def group(self) -> dist.ProcessGroup | None:
        """The group the ranks save over (None without torch.distributed, or once closed if made here)."""
        return None if self._group is None else self._group.get()

    def max(self, values: list[int], what: str) -> list[int]:
        """Element-wise maximum over the group (the values themselves without torch.distributed)."""
        if not self.distributed:
            return values
        tensor = torch.tensor(values, dtype=torch.int64)
        work = dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        bounded_wait(work, f"PipelineCheckpointer: {what}", timeout=self.timeout, group=self.group)
        return tensor.tolist()

    def agree_on_save(self, step: int, extra: Mapping[str, Any]) -> int:
        """Check that every rank saves ``step`` with the same ``extra``; the nonce of the temporary folder.

        Raises:
            ValueError: the ranks passed different steps, or different ``extra``.
        """
        check = digest(extra) if self.distributed else 0
        nonce = secrets.randbits(60) if self.coordinator else 0
        agreed = self.max([step, -step, check, -check, nonce], f"agreeing on checkpoint step {step}")
        if agreed[0] != -agreed[1]:
            raise ValueError(
                f"PipelineCheckpointer.save: the ranks save different steps ({-agreed[1]} .. {agreed[0]})"
            )
        if agreed[2] != -agreed[3]:
            raise ValueError(
                f"PipelineCheckpointer.save: extra differs between ranks (keys here: {sorted(extra)}); "
                "it is saved once for all ranks: pass each rank's own state as rank_extra"
            )
        return agreed[4]

    def choose_latest(self, root: Path) -> Path:
        """The newest complete checkpoint under ``root`` as the first rank sees it (a collective).

        Raises:
            FileNotFoundError: the first rank sees none.
        """
        found = latest_checkpoint(root) if self.coordinator else None
        (step,) = self.max([-1 if found is None else _step_of(found)], "choosing the latest checkpoint")
        if step < 0:
            raise FileNotFoundError(f"PipelineCheckpointer.load: no complete checkpoint under {root}")
        return checkpoint_path(root, step)

    def gather_layout(
        self, tensors: Mapping[int, Mapping[str, torch.Tensor]], n_stages: int
    ) -> tuple[list[list[str]], list[list[Any]]]:
        """Every stage's pieces and every rank's stages (a collective over the group).

        Args:
            tensors: this rank's ``{stage: {global name: tensor}}`` (:func:`.names.stage_tensors`).
            n_stages: stages of the whole pipeline.

        Returns:
            ``(partition, layout)``: per stage its model pieces, and per rank ``[rank, its stages]``.

        Raises:
            ValueError: two ranks cut a stage differently, or the group's ranks do not hold every stage.
        """
        mine = {
            "rank": self.rank,
            "stages": sorted(tensors),
            "partition": partition_of({s: list(e) for s, e in tensors.items()}),
        }
        gathered = [mine]
        if self.distributed:
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
        if sorted(partition) != list(range(n_stages)):
            raise ValueError(
                f"PipelineCheckpointer: the group's ranks hold stages {sorted(partition)} of {n_stages}; build it "
                "on every rank of the job"
            )
        layout = [[e["rank"], e["stages"]] for e in sorted(gathered, key=lambda e: e["rank"])]
        return [list(partition[s]) for s in range(n_stages)], layout

    def close(self) -> None:
        """Destroy the group when it was made here (every rank); a group passed in is left to its owner."""
        if self._owned and self._group is not None:
            group = self._group.get()
            self._group = None
            dist.destroy_process_group(group)


def digest(extra: Mapping[str, Any]) -> int:
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


def _require_numpy() -> None:
    try:
        import numpy  # noqa: F401
    except ImportError:
        raise RuntimeError(
            "PipelineCheckpointer: torch.distributed.checkpoint exchanges its plans with object collectives, "
            "which need numpy; pip install numpy (or splitgrad[checkpoint])"
        ) from None
