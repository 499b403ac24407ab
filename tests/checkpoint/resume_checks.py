"""Rank function of the resume matrix (module-level: pickled by name by ``spawn``).

4 gloo ranks, ``pipeline_groups(2, 2)``: pipelines ``{0, 1}`` and ``{2, 3}``, data-parallel pairs ``{0, 2}`` and
``{1, 3}``. Each case trains ``STEPS`` steps uninterrupted, checkpointing after step ``K``, then builds
everything again from *another* seed (and another global RNG state), loads the checkpoint and trains to
``STEPS``; it returns both runs' losses and what was restored, for the test to compare bitwise.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from splitgrad.models import GPT, GPTConfig, MoEConfig, lm_loss, set_aux_loss_scale, split_into_stages
from splitgrad.parallel.expert import ExpertDataParallel, ExpertParallelMoEGPT
from splitgrad.pipeline import build_runtime, pipeline_groups
from splitgrad.pipeline.checkpoint import PipelineCheckpointer

STEPS, K, M, BATCH, SEQ = 4, 2, 4, 8, 8


@dataclass(frozen=True)
class Case:
    label: str
    schedule: str
    n_stages: int
    layout: str = "half"  # "half": pp2 on {0,1} and on {2,3}; "ddp": pp2 x dp2; "ep": pp2 x ep2 (MoE)
    dropout: float = 0.0
    async_save: bool = False
    n_layers: int = 0  # 0: one per stage


def _config(case: Case) -> GPTConfig:
    common = dict(vocab_size=37, seq_len=SEQ, hidden_size=16, num_layers=case.n_layers or case.n_stages)
    common |= dict(num_heads=2)
    common |= dict(ffn_hidden_size=32, dropout=case.dropout, delay_wgrad_compute=True)
    if case.layout == "ep":
        return MoEConfig(**common, moe_ffn_hidden_size=16, num_experts=4, top_k=2, aux_loss_coef=0.01)
    return GPTConfig(**common, fuse_wgrad_accumulation=case.layout == "ddp")


def train(case: Case, env: dict, root: str, *, resume: str | None = None, seed: int = 0, **load) -> dict:
    """One run: ``STEPS`` steps (from the checkpoint ``resume`` when given), saving after step ``K``."""
    torch.manual_seed(seed)
    config = _config(case)
    if case.layout == "ep":
        model = ExpertParallelMoEGPT(config, ep_group=env["dp"], dp_group=env["dp"])
        set_aux_loss_scale(model, 1.0 / M)
        stages = [
            ExpertDataParallel(s, dp_group=env["dp"], expert_dp_group=env["self"], bucket_size=512)
            for s in split_into_stages(model, case.n_stages)
        ]
        dp = None
    else:
        model = GPT(config)
        stages, dp = split_into_stages(model, case.n_stages), env["dp"] if case.layout == "ddp" else None
    rt = build_runtime(
        stages, case.schedule, n_microbatches=M, loss_fn=lm_loss, pp_group=env["pp"], dp_group=dp,
        timeout=60, record_timeline=False,
    )  # fmt: skip
    opt = torch.optim.AdamW(rt.parameters(), lr=0.02, weight_decay=0.1)
    ckpt = PipelineCheckpointer(root, rt, model, opt, group=env["ckpt"])
    data = torch.Generator().manual_seed(100 + env["data_rank"])
    out: dict = {"losses": {}}
    first = 1
    if resume is not None:
        restored = ckpt.load(resume, **load)
        saved_data = restored.extra.get("data")
        if saved_data is None and restored.rank_extra is not None:
            saved_data = restored.rank_extra.get("data")
        if saved_data is not None:  # None: a replica's stream under another layout (not compared)
            data.set_state(saved_data)
        first = restored.step + 1
        out |= {"restored_step": restored.step, "rng_restored": restored.rng_restored}
        out["loaded"] = _state(model, rt, opt)
    for step in range(first, STEPS + 1):
        ids = torch.randint(0, 37, (BATCH, SEQ), generator=data)
        rt.zero_grad()
        out["losses"][step] = float(rt.step(ids, ids.roll(-1, dims=1)).loss)
        opt.step()
        if step == K and resume is None:
            out["saved"] = _state(model, rt, opt)
            where = "rank_extra" if case.layout in ("ddp", "ep") else "extra"  # a data stream per replica
            kwargs = {where: {"data": data.get_state()}}
            handle = ckpt.save(step, async_save=case.async_save, **kwargs)
            out["path"] = str(handle.path)
    ckpt.close()
    rt.close()
    return out


def _state(model, rt, opt) -> dict:
    """This rank's parameters and AdamW state by parameter name (copies), for bitwise comparisons."""
    mine = {id(p) for p in rt.parameters()}
    names = {id(p): n for n, p in model.named_parameters() if id(p) in mine}
    params = {names[id(p)]: p.detach().clone() for p in rt.parameters()}
    state = {names[id(p)]: {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()}
    return {"params": params, "optim": state}


def resume_matrix(rank: int, world: int, root: str) -> dict:
    g = pipeline_groups(pp_size=2, dp_size=2)
    halves = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    singles = [dist.new_group([r]) for r in range(world)]
    half = halves[rank // 2]
    env_half = {"pp": g.pp_group, "dp": g.dp_group, "ckpt": half, "data_rank": 0, "self": singles[rank]}
    env_2d = {**env_half, "ckpt": None, "data_rank": g.dp_rank}
    report: dict = {}

    def case(c: Case, env: dict) -> None:

        path = f"{root}/{c.label}"
        first = train(c, env, path)
        second = train(c, env, path, resume=first["path"], seed=1)
        report[c.label] = {"uninterrupted": first, "resumed": second}

    # Phase 1: two 2-rank pipelines at once, one schedule pair each.
    per_half = [
        [Case("1f1b", "1f1b", 2, dropout=0.1), Case("zbv", "zbv", 4, async_save=True)],
        [Case("zb-h1", "zb-h1", 2, async_save=True), Case("dualpipev", "dualpipev", 4)],
    ]
    for c in per_half[rank // 2]:
        case(c, env_half)
    if rank < 2:  # negatives: without the generators, or without the optimizer state, the run differs
        c = per_half[0][0]
        path = report[c.label]["uninterrupted"]["path"]
        report["1f1b-no-rng"] = train(
            c, env_half, f"{root}/{c.label}", resume=path, seed=1, restore_rng=False
        )
    dist.barrier()
    # Phase 2: pp2 x dp2 with DDP, and pp2 x ep2 with the experts sharded over the data-parallel pair.
    for c in [
        Case("1f1b-ddp", "1f1b", 2, layout="ddp"),
        Case("zbv-ddp", "zbv", 4, layout="ddp", async_save=True),
    ]:
        case(c, env_2d)
    case(Case("1f1b-ep", "1f1b", 2, layout="ep"), env_2d)
    # Phase 3: the zbv checkpoint of pipeline {0, 1} (2 ranks, 4 stages in a V) resumed by 1f1b on 4 ranks.
    env_4 = {"pp": None, "dp": None, "ckpt": None, "data_rank": 0, "self": singles[rank]}
    path = f"{root}/zbv/step_{K:08d}"
    report["zbv->1f1b"] = train(Case("zbv->1f1b", "1f1b", 4), env_4, f"{root}/zbv", resume=path, seed=2)
    report["zbv-owner"] = rank in (0, 1)  # held zbv's stages {0, 3} / {1, 2} in phase 1
    # Phase 4: the pp2 x dp2 checkpoint loaded by pp2 x dp1 on ranks {0, 1}; a 2-stage cut of zbv's 4-layer
    # model must be refused, naming both partitions.
    if rank < 2:
        env_1d = {**env_half, "data_rank": 0}
        ddp = Case("1f1b-ddp", "1f1b", 2)
        ddp_path = report["1f1b-ddp"]["uninterrupted"]["path"]
        report["dp2->dp1"] = train(ddp, env_1d, f"{root}/dp1", resume=ddp_path, seed=3)
        try:
            train(Case("cut-2", "1f1b", 2, n_layers=4), env_1d, f"{root}/cut", resume=path, seed=0)
        except ValueError as exc:
            report["partition_error"] = str(exc)
    dist.barrier()
    return report
