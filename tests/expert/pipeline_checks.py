"""Rank function of the pipeline x expert-parallel test (module-level: pickled by name by ``spawn``).

4 ranks: pipeline size 2 x expert-parallel size 2. Global rank ``e * 2 + p``: pipeline ``{0, 1}`` and
``{2, 3}`` (one per EP replica), expert-parallel groups ``{0, 2}`` (stage ranks 0) and ``{1, 3}``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import splitgrad
from splitgrad.models import MoEGPT, lm_loss, set_aux_loss_scale, split_into_stages
from splitgrad.parallel.expert import (
    ExpertParallelMoEGPT,
    ExpertParallelMoEMLP,
    OverlappedMoEStage,
    load_full_state_dict,
    set_wgrad_in_dispatch,
)
from splitgrad.pipeline import build_schedule
from splitgrad.pipeline.build import build_runtime, pipeline_groups
from splitgrad.pipeline.passes import fuse_overlap_pairs
from tests.expert.ep_checks import close, full_name
from tests.models.helpers import batch, build, moe_config

MB, M = 2, 4  # sequences per microbatch per replica, microbatches per step


def _reference(config, batches):
    """Gradients of mean_j (CE(global microbatch j) + aux_j) by the single-process model (delayed wgrad)."""
    ref = build(MoEGPT, config)
    set_aux_loss_scale(ref, 1.0 / M)
    ces = []
    for j in range(M):
        ids = torch.cat([b[0][j * MB : (j + 1) * MB] for b in batches])
        tgt = torch.cat([b[1][j * MB : (j + 1) * MB] for b in batches])
        ce = lm_loss(ref(ids), tgt)
        (ce / M).backward()  # the aux-loss gradient is injected by each MoE layer's backward
        ces.append(ce.detach())
    splitgrad.backward_dw(ref)
    return ref, torch.stack(ces).mean(), {n: p.grad for n, p in ref.named_parameters()}


def pipeline_ep(rank: int, world: int, runs: list[tuple]) -> dict:
    """Per run ``(label, schedule, overlapped stages[, delayed wgrad])``: the runtime's loss and gradients vs
    the reference (delayed wgrad by default; False: the experts' and dense weight gradients computed inside the
    backward, ``delay_wgrad_compute=False``).

    Returns, per label, the number of parameters checked, the expert-W runs inside dispatches on this rank
    and the gradients (for bitwise comparisons between runs).
    """
    g = pipeline_groups(pp_size=2, dp_size=2)
    ep_group = g.dp_group  # the ranks holding the same stage in the two replicas
    out: dict = {}
    refs: dict = {}
    for label, name, overlapped, *rest in runs:
        delayed = rest[0] if rest else True
        # Two stages per rank for the V and the virtual pipeline (Megatron's interleaved combined 1F1B).
        n_stages = 4 if name.startswith(("dualpipev", "interleaved")) else 2
        config = moe_config(num_layers=n_stages, seq_len=8, delay_wgrad_compute=delayed)
        batches = [batch(config, batch_size=M * MB, seq=8, seed=10 + d) for d in range(2)]
        if (n_stages, delayed) not in refs:
            refs[(n_stages, delayed)] = _reference(config, batches)
        ref, ref_ce, ref_grads = refs[(n_stages, delayed)]
        model = ExpertParallelMoEGPT(config, ep_group=ep_group, dp_group=ep_group)
        load_full_state_dict(model, ref.state_dict())
        set_aux_loss_scale(model, 1.0 / M)
        stages = split_into_stages(model, n_stages)
        log: list = []
        comm: list = []
        for layer in (m for m in model.modules() if isinstance(m, ExpertParallelMoEMLP)):
            layer.wgrad_log, layer.comm_log = log, comm
        if overlapped:
            # dualpipev and the interleaved pairs put the forward of one stage beside the backward of another:
            # set the layers themselves.
            set_wgrad_in_dispatch(model, True)
            stages = [OverlappedMoEStage(s, wgrad_in_dispatch=None) for s in stages]
        if name == "1f1b+overlap":
            schedule = fuse_overlap_pairs(build_schedule("1f1b", 2, M))
        elif name == "dualpipev-plain":
            schedule = build_schedule("dualpipev", 4, M, overlap=False)
        elif name == "interleaved-1f1b+overlap":
            schedule = build_schedule("interleaved-1f1b", 4, M, overlap=True)
        else:
            schedule = build_schedule(name, n_stages, M)
        rt = build_runtime(stages, schedule, loss_fn=lm_loss, pp_group=g.pp_group, timeout=120)
        ids, tgt = batches[g.dp_rank]
        result = rt.step(ids, tgt)
        if splitgrad.pending_wgrad(model):
            raise AssertionError(f"{label}: wgrad work left after the step")
        if overlapped and delayed and not log:
            raise AssertionError(f"{label}: no expert W ran inside a dispatch all-to-all")
        if not overlapped and log:
            raise AssertionError(f"{label}: expert W ran inside a dispatch without wgrad_in_dispatch")
        if overlapped:  # some forward exchange was issued while a backward exchange was in flight
            forward = [s for n, s, _ in comm if n in ("dispatch", "combine")]
            backward = [(s, e) for n, s, e in comm if n.endswith(" backward")]
            if not any(bs < fs < be for fs in forward for bs, be in backward):
                raise AssertionError(f"{label}: the overlapped pairs did not interleave their exchanges")
        loss = result.loss.reshape(1).to(torch.float64)
        dist.all_reduce(loss, group=ep_group)
        close(loss[0] / 2, ref_ce, f"{label}: loss")
        mine = {id(p) for p in rt.parameters()}
        got = {}
        for pname, p in model.named_parameters():
            if id(p) not in mine:
                continue
            grad = p.grad.clone()
            if not getattr(p, "expert_parallel", False):
                dist.all_reduce(grad, group=ep_group)  # dense: the mean over the two replicas
            got[pname] = grad
            close(grad / 2, ref_grads[full_name(model, pname)], f"{label}: {pname}")
        # Not trivially passing: this rank's expert 0 against the reference's expert 1 is rejected.
        layer = next(
            m for m in model.modules() if isinstance(m, ExpertParallelMoEMLP) and id(m.fc1.weight0) in mine
        )
        prefix = next(n for n, m in model.named_modules() if m is layer)
        wrong = f"{prefix}.fc1.weight{(layer.expert_offset + 1) % config.num_experts}"
        try:
            close(layer.fc1.weight0.grad / 2, ref_grads[wrong], "negative")
        except AssertionError:
            pass
        else:
            raise AssertionError(f"{label}: a wrong expert's gradient was accepted")
        pairs = sum(a.kind.value == "FB" for a in rt.actions)
        out[label] = {"checked": len(got), "in_dispatch": len(log), "grads": got, "pairs": pairs}
    return out
