"""Rank function of the SafeStep tests (module-level: pickled by name by ``spawn``).

4 gloo ranks, ``pipeline_groups(2, 2)``. Three layouts, one after the other: pp2 x dp2 with DDP (gradients in
``main_grad``), two pp2 pipelines without data parallelism (``.grad``), pp2 x ep2 (MoE, experts sharded over
the data-parallel pair, ``ExpertDataParallel``). In each, one ordinary step gives AdamW some state; the second
step's gradients are then put through every variant from the same saved state, and compared with the float64
single-process model on the global batch, clipped by ``torch.nn.utils.clip_grad_norm_``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from splitgrad.models import lm_loss, reference_twin, set_aux_loss_scale, split_into_stages
from splitgrad.parallel.expert import (
    ExpertDataParallel,
    ExpertParallelMoEGPT,
    full_state_names,
    load_full_state_dict,
)
from splitgrad.pipeline import build_runtime, pipeline_groups
from splitgrad.pipeline.safe_step import SafeStep
from tests.pipeline_runtime.workers import VOCAB, gpt_model

M, MB, SEQ = 4, 2, 8


def _batches(replicas: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(7)
    out = []
    for _ in range(replicas):
        ids = torch.randint(0, VOCAB, (M * MB, SEQ), generator=gen)
        out.append((ids, torch.randint(0, VOCAB, (M * MB, SEQ), generator=gen)))
    return out


def _reference(model, batches) -> torch.nn.Module:
    """The plain-autograd float64 twin, holding the gradients of the mean over global microbatches of CE
    (+ aux)."""
    twin = reference_twin(model)
    total = 0.0
    for j in range(M):
        ids = torch.cat([b[0][j * MB : (j + 1) * MB] for b in batches])
        tgt = torch.cat([b[1][j * MB : (j + 1) * MB] for b in batches])
        logits, aux = twin(ids)
        total = (
            total + (torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tgt.reshape(-1)) + aux) / M
        )
    total.backward()
    return twin


def _grad(p: torch.Tensor) -> torch.Tensor:
    return p.main_grad if getattr(p, "main_grad", None) is not None else p.grad


def _capture(params, opt) -> dict:
    return {
        "params": [p.detach().clone() for p in params],
        "grads": [_grad(p).clone() for p in params],
        "state": {i: {k: v.clone() for k, v in opt.state[p].items()} for i, p in enumerate(params)},
    }


def _restore(params, opt, saved) -> None:
    with torch.no_grad():
        for p, value, grad in zip(params, saved["params"], saved["grads"]):
            p.copy_(value)
            _grad(p).copy_(grad)
    for i, p in enumerate(params):
        opt.state[p] = {k: v.clone() for k, v in saved["state"][i].items()}


def _layout(kind: str, g, rank: int):
    """``(model, reference model, full names, stages, runtime kwargs, replicas)`` of a layout."""
    if kind != "ep":
        model, stages = gpt_model(2, fused=kind == "ddp")
        names = {id(p): n for n, p in model.named_parameters()}
        dp = g.dp_group if kind == "ddp" else None
        return model, model, names, stages, {"dp_group": dp}, (2 if kind == "ddp" else 1)
    full, _ = gpt_model(2, moe=True)
    torch.manual_seed(0)
    model = ExpertParallelMoEGPT(full.config, ep_group=g.dp_group, dp_group=g.dp_group)
    load_full_state_dict(model, full.state_dict())
    set_aux_loss_scale(model, 1.0 / M)
    set_aux_loss_scale(full, 1.0 / M)
    local = full_state_names(model)
    names = {id(p): local[n] for n, p in model.named_parameters()}
    single = [dist.new_group([r]) for r in range(4)][rank]  # every rank makes every group, in order
    stages = [
        ExpertDataParallel(s, dp_group=g.dp_group, expert_dp_group=single, bucket_size=256)
        for s in split_into_stages(model, 2)
    ]
    return model, full, names, stages, {}, 2


def safe_steps(rank: int, world: int) -> dict:
    g = pipeline_groups(pp_size=2, dp_size=2)
    out = {}
    for kind in ("ddp", "pp", "ep"):
        _, full, names, stages, extra, replicas = _layout(kind, g, rank)
        rt = build_runtime(
            stages, "zb-h1", n_microbatches=M, loss_fn=lm_loss, pp_group=g.pp_group, timeout=60,
            record_timeline=False, **extra,
        )  # fmt: skip
        params = rt.parameters()
        # Step 1 at lr 0: AdamW gets its state while every rank keeps the initial weights of the whole model,
        # where the reference runs (no rank holds the other stages' updated weights).
        opt = torch.optim.AdamW(params, lr=0.0)
        batches = _batches(replicas)
        ids, tgt = batches[g.dp_rank if replicas > 1 else 0]
        rt.step(ids, tgt)
        opt.step()
        opt.param_groups[0]["lr"] = 0.01
        twin = _reference(full, batches)
        ref = {n: p.grad for n, p in twin.named_parameters()}
        rt.zero_grad()
        rt.step(ids, tgt)
        ref_norm = torch.sqrt(sum((v.double() ** 2).sum() for v in ref.values() if v is not None)).item()
        local = torch.tensor(
            [float(sum((_grad(p).double() ** 2).sum() for p in params))], dtype=torch.float64
        )
        dist.all_reduce(local, op=dist.ReduceOp.MAX)
        # Above every rank's own norm, below the global one: each rank speculates, and the check fails.
        max_norm = ((local.item() + ref_norm**2) / 2) ** 0.5
        if kind == "pp":  # two independent jobs, one per pipeline
            groups = {"group": g.pp_group}
        else:  # dense parameters replicated over the data-parallel pair; experts sharded over it
            groups = {"dp_group": g.dp_group}
        saved = _capture(params, opt)
        runs = {}
        for label, kwargs in {
            "sync": {"max_norm": max_norm},
            "post": {"max_norm": max_norm, "post_validate": True},
            "sync-loose": {"max_norm": 1e6},
            "post-loose": {"max_norm": 1e6, "post_validate": True},
            "sync-inf": {"max_norm": max_norm},
            "post-inf": {"max_norm": max_norm, "post_validate": True},
        }.items():
            _restore(params, opt, saved)
            if label.endswith("inf") and rank == 1:
                _grad(params[0]).view(-1)[0] = float("inf")
            report = SafeStep(opt, **groups, **kwargs).step()
            runs[label] = {"report": report, **_capture(params, opt)}
        # Not trivially passing: clipping each rank by its own norm, as clip_grad_norm_ on its stages would.
        _restore(params, opt, saved)
        own = torch.nn.utils.get_total_norm([_grad(p) for p in params]).item()
        local_clip = [_grad(p) * min(1.0, max_norm / (own + 1e-6)) for p in params]
        torch.nn.utils.clip_grad_norm_(twin.parameters(), max_norm)  # the whole model's gradient
        refs = [ref[names[id(p)]] for p in params]
        out[kind] = {
            "ref_norm": ref_norm, "max_norm": max_norm, "saved": saved, "runs": runs,
            "ref_clipped": refs, "local_clip": local_clip, "names": [names[id(p)] for p in params],
        }  # fmt: skip
        rt.close()
    return out
