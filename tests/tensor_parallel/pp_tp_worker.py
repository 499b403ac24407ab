"""pp=2 x tp=2 on 4 gloo ranks: the pipeline runtime runs a tensor-parallel GPT (run by test_pp_tp.py)."""

from __future__ import annotations

import torch

import splitgrad
from splitgrad.models import GPT, GPTConfig, lm_loss, shard_gpt_state_dict, split_into_stages
from splitgrad.parallel import DistributedDataParallel as DDP
from splitgrad.parallel import tensor_parallel_groups
from splitgrad.parallel.tensor import allreduce_sequence_parallel_grads
from splitgrad.pipeline.build import build_runtime
from tests.pipeline_runtime.workers import MB, VOCAB, gpt_reference, token_batch

RTOL, ATOL = 1e-10, 1e-12


def pp_tp_worker(rank: int, world: int, schedules: list[str]) -> dict:
    """Per schedule: loss and every local gradient shard against the float64 tp=1 single-process reference.

    A schedule name ending in ``" sp"`` runs the model with sequence parallelism (activations between the
    stages are ``(seq / 2, batch, hidden)``) and all-reduces the partial gradients over the TP group after
    the step.
    """
    groups = tensor_parallel_groups(2)
    common = dict(vocab_size=VOCAB, seq_len=16, hidden_size=32, num_layers=2, num_heads=4, ffn_hidden_size=48,
                  params_dtype=torch.float64, delay_wgrad_compute=True)  # fmt: skip
    out = {}
    m = 4
    for name in schedules:
        schedule, sp = name.removesuffix(" sp"), name.endswith(" sp")
        full, model = _full_and_sharded(groups, common, sp)
        ids, tgt = token_batch(m, seed=100)
        ref_loss, ref = gpt_reference(full, ids.split(MB), tgt.split(MB))
        ref = shard_gpt_state_dict(ref, model.config, groups.tp_rank, 2)
        stages = split_into_stages(model, 2)
        rt = build_runtime(
            stages, schedule, n_microbatches=m, loss_fn=lm_loss, pp_group=groups.outer_group, timeout=120,
        )  # fmt: skip
        result = rt.step(ids, tgt)
        if sp:  # this rank's stage: one stage per pipeline rank in these schedules
            out[f"{name}:reduced"] = allreduce_sequence_parallel_grads(
                stages[groups.outer_rank], groups.tp_group
            )
        names = {id(p): n for n, p in model.named_parameters()}
        bad, params = [], list(rt.parameters())
        for p in params:
            n = names[id(p)]
            if p.grad is None or not torch.allclose(p.grad, ref[n], rtol=RTOL, atol=ATOL):
                bad.append(n)
        out[name] = {
            "bad": bad,
            "loss": result.loss.item(),
            "ref_loss": ref_loss,
            "w_tasks": result.w_tasks,
            "checked": len(params),
        }
    out["tp2xdp2 ddp"] = tp_dp_check(groups, common)
    out["tp2xdp2 ddp sp"] = tp_dp_check(groups, common, sp=True)
    return out


def tp_dp_check(groups, common: dict, sp: bool = False) -> dict:
    """tp=2 x dp=2: splitgrad DDP over the outer group of a TP GPT (deferred wgrad, hook-driven buckets).

    With ``sp`` the GPT is sequence parallel and the partial gradients are summed over the TP group after the
    data-parallel sync (in ``main_grad``).
    """
    full, model = _full_and_sharded(groups, common, sp)
    ddp = DDP(model, process_group=groups.outer_group, grad_reduce_dtype=None, bucket_size=2000, timeout=120)
    batches = [token_batch(1, seed=200 + d) for d in range(2)]
    ids, tgt = batches[groups.outer_rank]
    lm_loss(ddp(ids), tgt).backward()
    splitgrad.backward_dw(model)
    ddp.finish_grad_sync()
    reduced = allreduce_sequence_parallel_grads(model, groups.tp_group) if sp else 0
    ref_loss = sum(lm_loss(full(i), t) for i, t in batches) / 2  # the data-parallel average
    ref_loss.backward()
    splitgrad.backward_dw(full)
    ref = shard_gpt_state_dict(
        {n: p.grad for n, p in full.named_parameters()}, model.config, groups.tp_rank, 2
    )
    bad = [
        n
        for n, p in model.named_parameters()
        if not torch.allclose(p.main_grad, ref[n], rtol=RTOL, atol=ATOL)
    ]
    return {"bad": bad, "loss": ref_loss.item(), "ref_loss": ref_loss.item(), "w_tasks": 1,
            "checked": sum(1 for _ in model.parameters()), "reduced": reduced}  # fmt: skip


def _full_and_sharded(groups, common: dict, sp: bool) -> tuple[GPT, GPT]:
    """The seeded, jittered tp=1 GPT and its tp=2 twin holding this rank's shards."""
    torch.manual_seed(0)
    full = GPT(GPTConfig(**common))
    with torch.no_grad():
        for p in full.parameters():
            p.add_(0.05 * torch.randn_like(p))
    model = GPT(GPTConfig(**common, tp_size=2, sequence_parallel=sp), tp_group=groups.tp_group)
    model.load_state_dict(shard_gpt_state_dict(full.state_dict(), model.config, groups.tp_rank, 2))
    return full, model
