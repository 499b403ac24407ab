"""torchtitan's pipeline recipes with splitgrad layers: its own split, splitgrad's W step.

torchtitan (0.3.0) splits a model with ``torchtitan.distributed.pipeline_parallel``: stage FQNs
(``_generate_llm_fqn_per_model_part``), one pruned deep copy per stage (``_split_module``) and this rank's stage
indices (``_get_pp_rank_to_stage_indices_mapping``: the V for ``ZBVZeroBubble``/``DualPipeV``, the loop
otherwise). Its ``_pipeline_module_split`` then wraps each part in a plain ``PipelineStage``, whose I/W split
is PyTorch's autograd-graph surgery. :func:`pipeline_stages` does the same split with the same helpers, puts
splitgrad layers in place of the linears (:func:`convert_linears`) and wraps each part with
:func:`~splitgrad.pipeline.torch_adapter.splitgrad_pipeline_stage`, so ``W`` is splitgrad's parked weight
gradient. torchtitan's schedule builder (``_build_pipeline_schedule``: ``ZBVZeroBubble``,
``InterleavedZeroBubble``, a CSV ``_PipelineScheduleRuntime``) takes these stages unchanged.

torchtitan's trainer hands every stage per-microbatch keyword inputs (``positions`` and the FlexAttention
``BlockMask`` built for that microbatch) through ``schedule.step(arg_mbs=..., kwarg_mbs=...)``, an API newer
than torch 2.13, whose ``step()`` chunks whole-batch inputs (a ``BlockMask`` cannot be chunked).
:func:`step_microbatches` runs one step from such microbatch lists on torch 2.13.

torchtitan is imported when a function here is called, not when this module is imported.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..convert import convert
from ..pipeline.torch_adapter import SplitgradPipelineStage, splitgrad_pipeline_stage

__all__ = ["convert_linears", "pipeline_stages", "step_microbatches"]

logger = logging.getLogger(__name__)


def convert_linears(
    model: nn.Module, *, delay_wgrad_compute: bool = True, fuse_wgrad_accumulation: bool = False
) -> nn.Module:
    """:func:`splitgrad.convert` for torchtitan models: also converts torchtitan's ``Linear``.

    torchtitan's ``Linear`` subclasses ``nn.Linear`` only to be built from a config; it keeps
    ``nn.Linear.forward``. ``splitgrad.convert`` (today) converts exact ``nn.Linear``\\ s only, so each
    remaining subclass that keeps ``nn.Linear.forward`` is converted here, the same way: the splitgrad layer
    takes over the original ``Parameter`` objects (names, values and identity unchanged). Once ``convert``
    converts such subclasses itself, nothing is left for the second pass.

    Call it after ``model.init_states()``: the new layers keep the initialised parameters, not torchtitan's
    init config.

    Args:
        model: a torchtitan model or a part of one (converted in place).
        delay_wgrad_compute: the converted layers defer their weight gradient to ``backward_dw``.
        fuse_wgrad_accumulation: the converted layers add weight gradients into ``weight.main_grad``.

    Returns:
        ``model``.

    Raises:
        ValueError: an ``nn.Linear`` subclass overrides ``forward`` (it may compute something else; named
            with its class), or a linear has hooks registered (they would be lost); nothing is converted then.
    """
    options = {"delay_wgrad_compute": delay_wgrad_compute, "fuse_wgrad_accumulation": fuse_wgrad_accumulation}
    subclasses = _linear_subclasses(model)
    overriding = [
        f"{n} ({type(c).__qualname__})"
        for n, _, _, c in subclasses
        if type(c).forward is not nn.Linear.forward
    ]
    if overriding:
        raise ValueError(
            f"convert_linears: {overriding} subclass nn.Linear and override forward, so a splitgrad Linear "
            "would compute x @ W.T + b instead; convert the others by hand or leave the model as it is"
        )
    hooked = [n for n, _, _, c in subclasses if _has_hooks(c)]
    if hooked:
        raise ValueError(f"convert_linears: {hooked} have hooks registered; the swap would lose them")
    convert(model, **options)
    for name, parent, child_name, child in _linear_subclasses(model):
        # An exact nn.Linear on the meta device that adopts the subclass's parameters: convert() swaps it like
        # any nn.Linear (same checks, same Parameter objects) without this module repeating its code.
        plain = nn.Linear(child.in_features, child.out_features, bias=child.bias is not None, device="meta")
        plain.weight, plain.bias = child.weight, child.bias
        plain.train(child.training)
        setattr(parent, child_name, convert(plain, **options))
        logger.debug("convert_linears: %s (%s) -> splitgrad.Linear", name, type(child).__qualname__)
    return model


def pipeline_stages(
    model: nn.Module,
    module_names_per_stage: Sequence[Sequence[str]],
    schedule: str,
    *,
    group: dist.ProcessGroup,
    device: torch.device | str,
    fuse_wgrad_accumulation: bool = False,
) -> tuple[list[SplitgradPipelineStage], list[nn.Module]]:
    """torchtitan's ``_pipeline_module_split`` with splitgrad stages: this rank's stages of ``model``.

    Args:
        model: the whole torchtitan model, initialised (``init_states()``); it is copied, not changed.
        module_names_per_stage: module FQNs per stage, e.g. from torchtitan's
            ``_generate_llm_fqn_per_model_part(num_stages, num_layers)``.
        schedule: torchtitan's ``pipeline_parallel_schedule`` name (``"ZBVZeroBubble"``,
            ``"InterleavedZeroBubble"``, ``"PipelineScheduleMulti"`` for a CSV schedule, ...); it picks the
            stage-to-rank placement (V or loop) as torchtitan does.
        group: the pipeline-parallel process group (this rank's index in it is its pipeline rank).
        device: where the stages run.
        fuse_wgrad_accumulation: the splitgrad layers add weight gradients into ``weight.main_grad``.

    Returns:
        ``(stages, model_parts)``: this rank's :class:`SplitgradPipelineStage`\\ s in stage order of the
        placement, and their modules (each a pruned copy of ``model`` whose parameter names are the whole
        model's).

    Raises:
        ValueError: the stage count is not a multiple of the group size, or a stage holds no linear (e.g.
            ``tok_embeddings`` alone: give it a layer, as torchtitan's ``..._first_stage_less_layers=0``
            does, or use a plain ``PipelineStage`` for it).
    """
    from torchtitan.distributed.pipeline_parallel import (
        _get_pp_rank_to_stage_indices_mapping,
        _split_module,
    )

    n_stages, pp_degree, pp_rank = (
        len(module_names_per_stage),
        dist.get_world_size(group),
        dist.get_rank(group),
    )
    if n_stages % pp_degree:
        raise ValueError(
            f"pipeline_stages: {n_stages} stages do not split evenly over the {pp_degree} ranks of the group"
        )
    stage_ids = _get_pp_rank_to_stage_indices_mapping(pp_rank, pp_degree, schedule, n_stages)
    stages, parts = [], []
    for stage_index in stage_ids:
        part = _split_module(model, list(module_names_per_stage[stage_index]))
        convert_linears(part, fuse_wgrad_accumulation=fuse_wgrad_accumulation)
        stages.append(splitgrad_pipeline_stage(part, stage_index, n_stages, device, group=group))
        parts.append(part)
        logger.info(
            "pipeline_stages: rank %d stage %d holds %s",
            pp_rank,
            stage_index,
            module_names_per_stage[stage_index],
        )
    return stages, parts


def step_microbatches(
    schedule: Any,
    stages: Sequence[Any],
    *,
    arg_mbs: list[tuple[Any, ...]] | None,
    kwarg_mbs: list[dict[str, Any]],
    target_mbs: list[torch.Tensor] | None = None,
    losses: list[torch.Tensor] | None = None,
) -> None:
    """One training step from per-microbatch inputs, as torchtitan's ``step(arg_mbs=..., kwarg_mbs=...)``.

    Does what torch 2.13's ``step()`` does before its microbatch loop (stages told that the step runs
    backward, their per-step state cleared: splitgrad stages refuse to start while W work of the previous
    step is owed), then runs the schedule's microbatch loop (``_step_microbatches``, the method ``step()``
    calls; torch 2.13 has no public entry point that takes microbatch lists) on the given lists.

    Args:
        schedule: a ``torch.distributed.pipelining`` multi-stage schedule (``ScheduleZBVZeroBubble``,
            ``_PipelineScheduleRuntime``, ...) built with a ``loss_fn`` over ``stages``.
        stages: this rank's stages, as given to the schedule.
        arg_mbs: positional inputs per microbatch for the first stage (None on ranks without it), e.g.
            ``[(tokens_0,), (tokens_1,), ...]``, ``tokens_i: (microbatch_size, seq)``.
        kwarg_mbs: keyword inputs per microbatch for every stage, e.g.
            ``[{"positions": p_i, "attention_masks": block_mask_i}, ...]``.
        target_mbs: loss targets per microbatch for the last stage (None elsewhere).
        losses: a list that receives each microbatch's loss on the last stage.
    """
    for stage in stages:
        stage.has_backward = True
        stage.clear_runtime_states()
    schedule._step_microbatches(arg_mbs, kwarg_mbs, target_mbs, losses, return_outputs=False)


def _linear_subclasses(model: nn.Module) -> list[tuple[str, nn.Module, str, nn.Linear]]:
    """``(name, parent, child name, linear)`` for every strict ``nn.Linear`` subclass under ``model``."""
    return [
        (f"{parent_name}.{child_name}".lstrip("."), parent, child_name, child)
        for parent_name, parent in model.named_modules()
        for child_name, child in parent.named_children()
        if isinstance(child, nn.Linear) and type(child) is not nn.Linear
    ]


def _has_hooks(module: nn.Module) -> bool:
    return bool(
        module._forward_hooks
        or module._forward_pre_hooks
        or module._backward_hooks
        or module._backward_pre_hooks
        or module._state_dict_hooks
        or module._load_state_dict_pre_hooks
    )
