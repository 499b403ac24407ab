"""One validated description of a layer's tensor parallelism (TE's ``tp_group``/``tp_size``/``parallel_mode``).

Every tensor-parallel layer turns its constructor keywords into a :class:`TensorParallelConfig` here, so the
rules (and their error messages) exist once. It lives in ``distributed/`` rather than ``parallel/`` because
``module/`` needs it and dependencies point ``distributed -> module -> parallel``; ``splitgrad.parallel.tensor``
re-exports it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from .group_ref import GroupRef

__all__ = [
    "DEFAULT_TP_TIMEOUT_S",
    "PARALLEL_MODES",
    "TensorParallelConfig",
    "shard_size",
    "tensor_parallel_config",
]

#: Seconds a tensor-parallel collective may take before its wait raises (never a silent hang).
DEFAULT_TP_TIMEOUT_S = 300.0
#: TE's ``parallel_mode`` values (None: the layer is not split).
PARALLEL_MODES = (None, "column", "row")


@dataclass(frozen=True, kw_only=True, slots=True)
class TensorParallelConfig:
    """How one layer is split over its tensor-parallel group."""

    group_ref: GroupRef | None
    """Where the tensor-parallel process group is found (None: a single rank, ``size == 1``). The default
    group is looked up at each use and any other registered group held weakly (torch's registry keeps it
    until it is destroyed): a layer left in a script's globals must not keep gloo's worker threads running
    into interpreter shutdown, where they may abort the process (docs/parallel.md, "A crash at exit")."""
    size: int
    """Ranks in ``group`` (1 without a group)."""
    rank: int
    """This process's rank in ``group`` (0 without a group)."""
    parallel_mode: str | None
    """``"column"`` (output features sharded), ``"row"`` (input features sharded) or None."""
    sequence_parallel: bool
    """Activations outside the layer are sharded on dim 0 (sequence-first ``(s, b, h)``); only with size > 1."""
    timeout_s: float = DEFAULT_TP_TIMEOUT_S
    """Limit for every collective's wait."""

    @property
    def group(self) -> dist.ProcessGroup | None:
        """The group for torch's collectives: None for a single rank or the default group (which they use
        for ``group=None``); ``RuntimeError`` naming the holder once the group was destroyed."""
        return None if self.group_ref is None else self.group_ref.get_or_none()

    @property
    def splits(self) -> bool:
        """True when the layer's weight is sharded and its forward/backward communicate."""
        return self.size > 1 and self.parallel_mode is not None


def tensor_parallel_config(
    *,
    tp_group: dist.ProcessGroup | None,
    tp_size: int | None,
    parallel_mode: str | None,
    sequence_parallel: bool,
    owner: str,
    allowed_modes: tuple[str | None, ...] = PARALLEL_MODES,
) -> TensorParallelConfig:
    """Validate TE's tensor-parallel keywords and return the layer's config.

    Args:
        tp_group: the tensor-parallel group, or None (one rank).
        tp_size: expected group size; None takes the group's. Without a group only 1 (or None) is accepted:
            splitgrad has no ``set_tensor_parallel_group`` to supply the group later.
        parallel_mode: one of ``allowed_modes``.
        sequence_parallel: activations sharded on dim 0 outside the layer; needs a ``parallel_mode``. Like
            TE, it is a no-op on a one-rank group.
        owner: the layer, for error messages.
        allowed_modes: the modes this layer supports (``LayerNormLinear``: None and ``"column"``).

    Raises:
        ValueError: an unknown ``parallel_mode``, a ``tp_size`` that contradicts the group, ``tp_size > 1``
            without a group, ``sequence_parallel`` without a ``parallel_mode``.
        RuntimeError: a group is given but torch.distributed is not initialised.
    """
    if parallel_mode not in allowed_modes:
        raise ValueError(f"{owner}: parallel_mode must be one of {allowed_modes}, got {parallel_mode=}")
    if tp_size is not None and (not isinstance(tp_size, int) or tp_size < 1):
        raise ValueError(f"{owner}: tp_size must be a positive int, got {tp_size=}")
    if tp_group is None:
        size, rank = (1 if tp_size is None else tp_size), 0
        if size != 1:
            raise ValueError(
                f"{owner}: {tp_size=} needs tp_group (the tensor-parallel process group); pass tp_group=... "
                "(see splitgrad.parallel.tensor.tensor_parallel_groups)"
            )
    else:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(f"{owner}: tp_group given but torch.distributed is not initialised")
        size, rank = dist.get_world_size(tp_group), dist.get_rank(tp_group)
        if tp_size is not None and tp_size != size:
            raise ValueError(f"{owner}: {tp_size=} but tp_group has {size} ranks")
    if sequence_parallel and parallel_mode is None and size > 1:
        raise ValueError(
            f"{owner}: sequence_parallel=True needs parallel_mode='column' or 'row' (got {parallel_mode=})"
        )
    return TensorParallelConfig(
        group_ref=None if tp_group is None else GroupRef(tp_group, owner=f"{owner}.tp_group"),
        size=size,
        rank=rank,
        parallel_mode=parallel_mode,
        sequence_parallel=bool(sequence_parallel) and size > 1,
    )


def shard_size(full: int, cfg: TensorParallelConfig, *, owner: str, name: str) -> int:
    """``full // cfg.size``, or ``ValueError`` naming the layer when ``full`` does not divide."""
    if full % cfg.size:
        raise ValueError(
            f"{owner}: {name}={full} is not divisible by the tensor-parallel size {cfg.size} "
            f"(parallel_mode={cfg.parallel_mode!r})"
        )
    return full // cfg.size
