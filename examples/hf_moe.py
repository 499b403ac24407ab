"""A HuggingFace transformers v5 MoE model trained with splitgrad on 2 ranks (gloo on CPU, NCCL on GPUs).

1. Expert parallelism: ``splitgrad.convert`` makes the experts (and linears) defer their weight gradient;
   ``shard_hf_experts`` keeps 2 of the 4 experts of every MoE layer on each rank and moves the tokens with
   splitgrad's all-to-all dispatcher; the experts' W runs inside the backward's dispatch all-to-all;
   ``ExpertDataParallel`` averages the dense gradients over the ranks. A few AdamW steps.
2. A zero-bubble pipeline: the same kind of model cut by ``hf_pipeline_stages`` into 2 stages (each rebuilds
   the rotary embeddings and the causal mask) and run by splitgrad's runtime with the ``zb-h1`` schedule.

The model is a tiny random Qwen3-MoE built from a config (no download). Run::

    torchrun --nproc-per-node 2 examples/hf_moe.py
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

import splitgrad
from splitgrad.integrations.transformers import hf_pipeline_stages, shard_hf_experts
from splitgrad.models import lm_loss
from splitgrad.parallel.expert import ExpertDataParallel
from splitgrad.pipeline import build_runtime

VOCAB = 128


def tiny_qwen3_moe() -> Qwen3MoeForCausalLM:
    """2 layers, hidden 64, 4 experts of width 32, top-2 (the same seeded weights on every rank)."""
    torch.manual_seed(0)
    config = Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=64, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
        tie_word_embeddings=False,
    )  # fmt: skip
    return Qwen3MoeForCausalLM(config).train()


def batch(seed: int, size: int = 4, seq: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids, next-token targets)``, ``(size, seq)`` int64."""
    ids = torch.randint(0, VOCAB, (size, seq + 1), generator=torch.Generator().manual_seed(seed))
    return ids[:, :-1], ids[:, 1:]


def expert_parallel(steps: int = 3) -> list[float]:
    """Train with the experts sharded over every rank; returns the global loss of each step."""
    world, rank = dist.get_world_size(), dist.get_rank()
    model = splitgrad.convert(tiny_qwen3_moe(), delay_wgrad_compute=True)
    shard_hf_experts(model, dist.group.WORLD)  # expert-parallel group: every rank
    for module in model.modules():
        if hasattr(module, "wgrad_in_dispatch"):
            module.wgrad_in_dispatch = True  # expert W inside the backward's dispatch all-to-all
    # Each rank holds its own experts: their expert-data-parallel group is the rank alone.
    singles = [dist.new_group([r]) for r in range(world)]
    edp = ExpertDataParallel(model, dp_group=dist.group.WORLD, expert_dp_group=singles[rank])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for step in range(steps):
        ids, targets = batch(seed=step * world + rank)  # this rank's tokens
        edp.zero_grad_buffer()
        loss = lm_loss(edp(input_ids=ids).logits, targets)
        loss.backward()  # experts' W already ran inside the dispatch; the dense W is deferred
        splitgrad.backward_dw(edp)  # the dense W; their hooks start the gradient all-reduce
        edp.finish_grad_sync()
        opt.step()
        total = loss.detach().reshape(1)
        dist.all_reduce(total)
        losses.append(total.item() / world)
    edp.close()
    return losses


def pipeline(steps: int = 2) -> list[float]:
    """Train the model cut into one stage per rank with the ``zb-h1`` schedule; returns each step's loss."""
    model = splitgrad.convert(tiny_qwen3_moe(), delay_wgrad_compute=True)
    stages = hf_pipeline_stages(
        model, dist.get_world_size()
    )  # embedding on the first, norm + head on the last
    losses = []
    with build_runtime(stages, "zb-h1", n_microbatches=4, loss_fn=lm_loss) as rt:
        opt = torch.optim.AdamW(rt.parameters(), lr=1e-3)
        for step in range(steps):
            ids, targets = batch(seed=100 + step)  # the same batch on every rank
            result = rt.step(ids, targets)  # stage 0 reads ids, the last stage reads targets
            opt.step()
            rt.zero_grad()
            losses.append(result.loss.item())
    return losses


def main() -> None:
    dist.init_process_group("gloo")
    ep_losses = expert_parallel()
    pp_losses = pipeline()
    if dist.get_rank() == 0:
        print("expert parallel, loss per step:", [round(x, 4) for x in ep_losses])
        print("zb-h1 pipeline, loss per step:", [round(x, 4) for x in pp_losses])
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
