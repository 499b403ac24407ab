"""Checks run inside 2 spawned gloo ranks for the torchtitan integration (not a test module).

Each check builds torchtitan's recipe the way its trainer does (``pipeline_llm``): the shrunk llama3 debug
model split with torchtitan's stage FQNs and V/loop placement (here through
:func:`splitgrad.integrations.torchtitan.pipeline_stages`, which swaps the linears for splitgrad layers and
the stages for ``splitgrad_pipeline_stage``), torchtitan's full activation checkpointing on every part (its
zero-bubble recipes all set ``FullAC``), the schedule from torchtitan's own ``_build_pipeline_schedule``, and
one step with per-microbatch ``positions`` and FlexAttention ``BlockMask`` keyword inputs. The step's losses
and every gradient of the rank's stages must equal the one-process model's (float64).

:func:`run_checks` runs them in one process group and returns ``{check: None | traceback}``; ranks agree
after each check whether to go on.
"""

from __future__ import annotations

import os
import tempfile
import traceback

import torch
import torch.distributed as dist
from torch import nn

import splitgrad
from splitgrad.integrations.torchtitan import pipeline_stages, step_microbatches
from splitgrad.pipeline import Action, ActionKind, Schedule, validate
from splitgrad.testing import assert_grads_close
from splitgrad.testing.flex_cpu import torchtitan_flex_on_cpu
from tests.integrations import titan_tiny

#: check name -> (torchtitan pipeline_parallel_schedule, expected schedule class name, CSV file or not)
RECIPES = {
    "zbv": ("ZBVZeroBubble", "ScheduleZBVZeroBubble", False),
    "interleaved_zero_bubble": ("InterleavedZeroBubble", "ScheduleInterleavedZeroBubble", False),
    "custom_csv": ("PipelineScheduleMulti", "_PipelineScheduleRuntime", True),
}
ALL = list(RECIPES)
#: FQN infix torchtitan's FullAC (torch's checkpoint_wrapper) adds; the reference model has none.
WRAPPED = "_checkpoint_wrapped_module."


def deferred_w_schedule(n_ranks: int, n_microbatches: int) -> Schedule:
    """Loop placement (rank ``r`` holds ``r`` and ``r + n_ranks``): every forward, then every input gradient,
    then every weight gradient, so each ``W`` runs long after its ``I`` (the CSV recipe's schedule)."""
    ranks = []
    for r in range(n_ranks):
        low, high, mbs = r, r + n_ranks, range(n_microbatches)
        acts = [Action(s, ActionKind.F, m) for s in (low, high) for m in mbs]
        acts += [Action(s, ActionKind.B, m) for s in (high, low) for m in mbs]
        acts += [Action(s, ActionKind.W, m) for s in (high, low) for m in mbs]
        ranks.append(acts)
    return Schedule("deferred-w", n_microbatches, tuple(s % n_ranks for s in range(2 * n_ranks)), ranks)


def run_recipe(rank: int, world: int, check: str, model: nn.Module, data: dict, ref: tuple) -> list:
    """One step of the recipe ``check``; raises unless losses and gradients equal ``ref``. Returns the losses."""
    from torchtitan.config import ParallelismConfig
    from torchtitan.distributed.activation_checkpoint import FullAC
    from torchtitan.distributed.pipeline_parallel import (
        _build_pipeline_schedule,
        _generate_llm_fqn_per_model_part,
    )

    schedule_name, class_name, from_csv = RECIPES[check]
    n_stages = 2 * world
    fqns = _generate_llm_fqn_per_model_part(n_stages, titan_tiny.N_LAYERS)
    stages, parts = pipeline_stages(model, fqns, schedule_name, group=dist.group.WORLD, device="cpu")
    for part in parts:
        left = [n for n, m in part.named_modules() if isinstance(m, nn.Linear)]
        assert not left, f"linears left unconverted: {left}"
        assert list(splitgrad.split_modules(part)), "no splitgrad layer in the stage"
        FullAC(FullAC.Config()).apply(part)  # after the split, as torchtitan's parallelize_fn does
    with tempfile.TemporaryDirectory() as tmp:
        csv_path = ""
        if from_csv:
            plan = deferred_w_schedule(world, titan_tiny.N_MICROBATCHES)
            validate(plan)
            csv_path = os.path.join(tmp, "schedule.csv")
            with open(csv_path, "w") as f:
                f.write(plan.to_csv())
        parallelism = ParallelismConfig(
            pipeline_parallel_degree=world,
            pipeline_parallel_schedule=schedule_name,
            pipeline_parallel_schedule_csv=csv_path,
        )
        schedule = _build_pipeline_schedule(
            parallelism=parallelism,
            local_batch_size=titan_tiny.N_MICROBATCHES,
            stages=stages,
            loss_fn=titan_tiny.loss_fn,
        )
    assert type(schedule).__name__ == class_name, type(schedule).__name__
    first, last = any(s.is_first for s in stages), any(s.is_last for s in stages)
    losses: list[torch.Tensor] | None = [] if last else None
    step_microbatches(
        schedule,
        stages,
        arg_mbs=[(t,) for t in data["tokens"]] if first else None,
        kwarg_mbs=[{"positions": p, "attention_masks": m} for p, m in zip(data["positions"], data["masks"])],
        target_mbs=data["labels"] if last else None,
        losses=losses,
    )
    for stage in stages:
        assert stage.pending_microbatches == (), (
            f"stage {stage.stage_index} owes W {stage.pending_microbatches}"
        )
    ref_losses, ref_grads = ref
    got = {n.replace(WRAPPED, ""): p.grad for part in parts for n, p in part.named_parameters()}
    missing = sorted(n for n, g in got.items() if g is None)
    assert not missing, f"no gradient for {missing}"
    assert_grads_close(got, {n: ref_grads[n] for n in got}, what=f"{check} rank {rank}")
    if losses is not None:
        torch.testing.assert_close(torch.stack(losses), torch.stack(ref_losses), rtol=1e-12, atol=0)
    return losses or []


def run_checks(rank: int, world: int, names: list[str]) -> dict[str, str | None]:
    """Run the recipes ``names``; after the first failure on any rank the rest are reported as not run.

    A last entry, ``"mask_matters"``, holds the negative check: the pipeline's losses differ from a reference
    that ignores the document boundaries (a causal mask only), so the BlockMask the stages received is the
    one that shaped the result.
    """
    results: dict[str, str | None] = {}
    failed: str | None = None
    with torchtitan_flex_on_cpu():
        model = titan_tiny.debug_model()
        data = titan_tiny.batch(model)
        ref = titan_tiny.reference(model, data)
        losses: list = []
        for name in names:
            if failed is not None:
                results[name] = f"not run: {failed} failed first"
                continue
            try:
                losses = run_recipe(rank, world, name, model, data, ref)
                results[name] = None
            except Exception:
                results[name] = traceback.format_exc()
            flag = torch.tensor([results[name] is not None], dtype=torch.int32)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            if flag.item():
                failed = name
        results["mask_matters"] = None
        if losses and failed is None:
            try:
                causal = [model.get_attention_masks(torch.arange(titan_tiny.SEQ).unsqueeze(0))] * len(losses)
                wrong = titan_tiny.losses_with(model, data, causal)
                gap = (torch.stack(losses) - torch.stack(wrong)).abs().min().item()
                assert gap > 1e-6, f"a causal-only reference gives the same losses (gap {gap:.3g})"
            except Exception:
                results["mask_matters"] = traceback.format_exc()
    return results
