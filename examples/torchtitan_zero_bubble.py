"""torchtitan's zero-bubble pipeline recipe (ZBVZeroBubble) with splitgrad layers, on 2 gloo ranks.

Run: ``torchrun --nproc-per-node 2 examples/torchtitan_zero_bubble.py`` (needs ``requirements-torchtitan.txt``).

torchtitan's own split (stage FQNs, one pruned copy per stage, the V stage-to-rank placement) and its schedule
builder; splitgrad contributes the linears (their weight gradient parked for the schedule's ``W``) and the stage
wrapper. Every microbatch carries its own ``positions`` and FlexAttention ``BlockMask`` (packed documents), as
in torchtitan's trainer. Rank 1 prints the losses; both ranks compare their gradients with one process running
the whole model.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from splitgrad.integrations.torchtitan import pipeline_stages, step_microbatches
from splitgrad.testing.flex_cpu import torchtitan_flex_on_cpu

N_LAYERS, SEQ, N_MICROBATCHES = 3, 128, 4  # 3 layers: every one of the 4 stages holds a linear


def loss_fn(pred: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """torchtitan's cross-entropy over the step's tokens, as ``(loss, metrics)`` (its schedule builder's form)."""
    from torchtitan.components.loss import cross_entropy_loss

    return cross_entropy_loss(pred, labels) / (N_MICROBATCHES * SEQ), {}


def main() -> None:
    from torchtitan.config import ParallelismConfig
    from torchtitan.distributed.pipeline_parallel import (
        _build_pipeline_schedule,
        _generate_llm_fqn_per_model_part,
    )
    from torchtitan.models.llama3 import llama3_configs

    dist.init_process_group("gloo")
    world = dist.get_world_size()
    # torchtitan's llama3 debug model, cut to N_LAYERS layers, float64 for an exact comparison.
    config = llama3_configs["debugmodel"](attn_backend="flex")
    config.layers = config.layers[:N_LAYERS]
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(0)
    model = config.build()
    model.init_states()

    gen = torch.Generator().manual_seed(1)
    tokens = [torch.randint(0, config.vocab_size, (1, SEQ), generator=gen) for _ in range(N_MICROBATCHES)]
    labels = [torch.randint(0, config.vocab_size, (1, SEQ), generator=gen) for _ in range(N_MICROBATCHES)]
    # two packed documents per row, cut at a different place in each microbatch
    positions = [torch.cat([torch.arange(c), torch.arange(SEQ - c)]).unsqueeze(0) for c in (50, 20, 90, 64)]

    # torch 2.13 refuses FlexAttention's backward on CPU; on a GPU, drop this context.
    with torchtitan_flex_on_cpu():
        masks = [model.get_attention_masks(p) for p in positions]

        fqns = _generate_llm_fqn_per_model_part(2 * world, N_LAYERS)
        stages, parts = pipeline_stages(model, fqns, "ZBVZeroBubble", group=dist.group.WORLD, device="cpu")
        schedule = _build_pipeline_schedule(
            parallelism=ParallelismConfig(
                pipeline_parallel_degree=world, pipeline_parallel_schedule="ZBVZeroBubble"
            ),
            local_batch_size=N_MICROBATCHES,
            stages=stages,
            loss_fn=loss_fn,
        )
        has_first, has_last = any(s.is_first for s in stages), any(s.is_last for s in stages)
        losses: list[torch.Tensor] = []
        step_microbatches(
            schedule,
            stages,
            arg_mbs=[(t,) for t in tokens] if has_first else None,
            kwarg_mbs=[{"positions": p, "attention_masks": m} for p, m in zip(positions, masks)],
            target_mbs=labels if has_last else None,
            losses=losses if has_last else None,
        )

        reference = copy.deepcopy(model)
        for tok, lab, pos, mask in zip(tokens, labels, positions, masks):
            loss_fn(reference(tok, positions=pos, attention_masks=mask), lab)[0].backward()
    want = dict(reference.named_parameters())
    worst = max(
        (p.grad - want[name].grad).abs().max().item() for part in parts for name, p in part.named_parameters()
    )
    if has_last:
        print(f"rank {dist.get_rank()}: losses {[round(x.item(), 6) for x in losses]}")
    print(
        f"rank {dist.get_rank()}: stages {[s.stage_index for s in stages]}, max |grad - reference| = {worst:.2e}"
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
