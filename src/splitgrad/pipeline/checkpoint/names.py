"""The names a checkpoint keys tensors by: the whole model's, whatever rank holds a stage.

A pipeline rank holds a few stages, possibly wrapped (a data-parallel wrapper adds ``module.``), and with
expert parallelism only its share of each MoE layer's experts. Keyed by those local names, a checkpoint could
only be loaded by the same layout. So every tensor is named as the *whole model* names it
(``blocks.3.attn.qkv.weight``), found by identity in the model every rank builds, with an expert named by its
global index (:func:`splitgrad.parallel.expert.full_state_names`): the keys are then the same under any
schedule, rank layout, data-parallel or expert-parallel size.

The *partition* is what must match for a checkpoint to load: which pieces of the model (``embed``,
``blocks.0``, ..., ``head``: a name up to its first module index) each stage holds.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn

from ...distributed.tp_config import TensorParallelConfig
from ...parallel.expert import full_state_names

__all__ = ["describe_partition", "partition_of", "piece_of", "stage_tensors"]

Partition = tuple[tuple[str, ...], ...]
"""Per stage (in order), the model pieces it holds."""


def stage_tensors(model: nn.Module, stages: Mapping[int, nn.Module]) -> dict[int, dict[str, torch.Tensor]]:
    """Per local stage, ``{global name: tensor}`` of its parameters and persistent buffers.

    Args:
        model: the whole model the stages were cut from (every rank builds it; a stage's tensors are found in
            it by identity, so wrappers around a stage do not change the names).
        stages: this rank's ``{stage index: module}`` (e.g. ``PipelineRuntime.stages``).

    Raises:
        ValueError: a stage tensor that ``model`` does not hold (another model was passed), or a
            tensor-parallel layer (its weights are shards under one name; not supported).
    """
    owners = full_state_names(model)
    by_id: dict[int, str] = {}
    for key, tensor in model.state_dict(keep_vars=True).items():
        by_id.setdefault(id(tensor), owners[key])
    out: dict[int, dict[str, torch.Tensor]] = {}
    for s, module in sorted(stages.items()):
        _refuse_tensor_parallel(s, module)
        entries: dict[str, torch.Tensor] = {}
        for local, tensor in module.state_dict(keep_vars=True).items():
            name = by_id.get(id(tensor))
            if name is None:
                raise ValueError(
                    f"checkpoint: stage {s}'s tensor {local!r} {tuple(tensor.shape)} is not a tensor of the "
                    f"model passed ({type(model).__name__}); pass the model the stages were cut from"
                )
            entries[name] = tensor
        out[s] = entries
    return out


def _refuse_tensor_parallel(stage: int, module: nn.Module) -> None:
    for name, m in module.named_modules():
        tp = getattr(m, "tp", None)
        if isinstance(tp, TensorParallelConfig) and tp.splits:
            raise ValueError(
                f"checkpoint: stage {stage}'s {name or type(m).__name__} is tensor-parallel (tp_size={tp.size}): "
                "its weights are shards under one name, which this checkpoint does not save"
            )


def piece_of(name: str) -> str:
    """The model piece a tensor name belongs to: its first component, with the next one when that is a module
    index (``blocks.3.attn.qkv.weight`` -> ``blocks.3``, ``embed.wte.weight`` -> ``embed``, ``0.weight`` -> ``0``)."""
    parts = name.split(".")
    if len(parts) > 2 and parts[1].isdigit():
        return f"{parts[0]}.{parts[1]}"
    return parts[0]


def partition_of(stage_names: Mapping[int, Sequence[str]]) -> dict[int, tuple[str, ...]]:
    """Per stage, its pieces in order of first appearance (see :func:`piece_of`)."""
    return {s: tuple(dict.fromkeys(piece_of(n) for n in names)) for s, names in stage_names.items()}


def describe_partition(partition: Sequence[Sequence[str]]) -> str:
    """One line: ``stage 0: embed, blocks.0-1 | stage 1: blocks.2-3, head`` (runs of indices folded)."""
    return " | ".join(f"stage {s}: {_fold(pieces)}" for s, pieces in enumerate(partition))


def _fold(pieces: Sequence[str]) -> str:
    """``blocks.0, blocks.1, blocks.2`` -> ``blocks.0-2``."""
    out: list[str] = []
    run: tuple[str, int, int] | None = None
    for piece in (*pieces, None):
        head, _, index = piece.rpartition(".") if piece is not None else ("", "", "")
        if run is not None and head == run[0] and index.isdigit() and int(index) == run[2] + 1:
            run = (run[0], run[1], int(index))
            continue
        if run is not None:
            out.append(f"{run[0]}.{run[1]}" + (f"-{run[2]}" if run[2] != run[1] else ""))
            run = None
        if piece is None:
            break
        if head and index.isdigit():
            run = (head, int(index), int(index))
        else:
            out.append(piece)
    return ", ".join(out) if out else "(nothing)"
