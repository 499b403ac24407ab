"""One rank's share of a checkpoint: the flat state dict it writes, and the buffers a load reads back into.

A rank writes its stages' tensors under the whole model's names (:mod:`.names`), its optimizer's state by
parameter name, its generators and its own ``rank_extra`` under its rank, and the job's ``step`` and ``extra``
(:mod:`.state` for each kind). Reading back, it takes what it can use: its stages' tensors (read in place,
checked against the saved shape and dtype), its optimizer's parameters' state, the job's state, and its
generators and ``rank_extra`` only under the rank layout that saved them.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .names import stage_tensors
from .state import (
    apply_optimizer_state,
    apply_rng_state,
    decode,
    encode,
    optimizer_entries,
    optimizer_keys,
    rng_entries,
)

__all__ = ["RankShare", "decode_extras"]


class RankShare:
    """The tensors, optimizer state and generators one rank saves and restores, keyed by global names.

    Args:
        model: the whole model the stages were cut from (names only).
        stages: this rank's ``{stage index: module}``.
        optimizer: this rank's optimizer (over the stages' parameters), or None.

    Raises:
        ValueError: a stage tensor that ``model`` does not hold, or an optimizer parameter not in the stages.
    """

    def __init__(
        self, model: nn.Module, stages: Mapping[int, nn.Module], optimizer: torch.optim.Optimizer | None
    ) -> None:
        self.tensors = stage_tensors(model, stages)
        """Per local stage, ``{global name: tensor}``."""
        self.optimizer = optimizer
        self._names = {id(t): name for entries in self.tensors.values() for name, t in entries.items()}
        if optimizer is not None:
            optimizer_entries(optimizer, self._names)  # raises on a parameter outside the stages

    def state_dict(
        self,
        step: int,
        extra: Mapping[str, torch.Tensor],
        rank_extra: Mapping[str, Any],
        *,
        rank: int,
        device: torch.device,
    ) -> dict[str, torch.Tensor]:
        """What this rank writes after ``step`` optimizer steps.

        Args:
            step: optimizer steps taken.
            extra: the job's state, already encoded as ``{"extra.<key>": tensor}``.
            rank_extra: this rank's own state (encoded here under ``rank<rank>.``).
            rank: this process's rank (its generators and ``rank_extra`` are saved under it).
            device: the runtime's device (its accelerator's generator is saved too).
        """
        state = {f"model.{n}": t.detach() for entries in self.tensors.values() for n, t in entries.items()}
        if self.optimizer is not None:
            state.update(optimizer_entries(self.optimizer, self._names))
        state.update(rng_entries(rank, device))
        state["step"] = torch.tensor(step, dtype=torch.int64)
        state.update(extra)
        state.update({f"rank{rank}.{k}": encode(v) for k, v in rank_extra.items()})
        return state

    def read_buffers(
        self, saved: Mapping[str, Any], path: Path, *, rank: int, rng: bool, own: bool
    ) -> dict[str, torch.Tensor]:
        """The state dict a load of ``path`` reads into: the stages' tensors themselves, and an empty buffer of
        the saved size and dtype for every other entry this rank restores.

        Args:
            saved: the checkpoint's metadata per key (DCP's ``state_dict_metadata``).
            path: the checkpoint (for the messages).
            rank: this process's rank.
            rng: read this rank's saved generator states, if there are any.
            own: read this rank's ``rank_extra`` (only under the rank layout that saved it).

        Raises:
            ValueError: a stage tensor that was not saved, or saved with another shape or dtype.
        """
        state: dict[str, Any] = {}
        for entries in self.tensors.values():
            for name, tensor in entries.items():
                state[f"model.{name}"] = _checked(f"model.{name}", tensor.detach(), saved, path)
        if self.optimizer is not None:
            for key in optimizer_keys(self.optimizer, self._names, saved):
                state[key] = _empty_like_saved(saved[key])
        for key in [k for k in saved if k.startswith(f"rng.rank{rank}.")] if rng else ():
            state[key] = _empty_like_saved(saved[key])
        rank_keys = [k for k in saved if k.startswith(f"rank{rank}.")] if own else []
        for key in [k for k in saved if k.startswith("extra.") or k == "step"] + rank_keys:
            state[key] = _empty_like_saved(saved[key])
        return state

    def restore(self, state: Mapping[str, torch.Tensor], *, rank: int, device: torch.device) -> bool:
        """Set the optimizer's state, and this rank's generators when ``state`` holds them (as read into
        :meth:`read_buffers`' dict).

        Returns:
            Whether the generators were set.
        """
        if self.optimizer is not None:
            apply_optimizer_state(self.optimizer, self._names, state)
        rng_restored = any(k.startswith(f"rng.rank{rank}.") for k in state)
        if rng_restored:
            apply_rng_state(rank, device, state)
        return rng_restored


def decode_extras(
    state: Mapping[str, torch.Tensor], *, rank: int, own: bool
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The job's ``extra`` and, when ``own`` (the rank layout that saved it), this rank's ``rank_extra``, as
    read into :meth:`RankShare.read_buffers`' dict."""
    extra = {k[len("extra.") :]: decode(v) for k, v in state.items() if k.startswith("extra.")}
    prefix = f"rank{rank}."
    rank_extra = (
        {k[len(prefix) :]: decode(v) for k, v in state.items() if k.startswith(prefix)} if own else None
    )
    return extra, rank_extra


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
