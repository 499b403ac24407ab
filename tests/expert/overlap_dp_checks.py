"""Rank function: ExpertDataParallel x batch-level overlap (module-level: pickled by name by ``spawn``).

EP = 2 x expert-DP = 2 on 4 ranks, two microbatches in flight, delayed wgrad: ``F0 (F1 || B0) B1 W`` through
the wrapper against ``F0 B0 F1 B1 W`` and the single-process ``MoEGPT``. The overlapped pair's backward fires
wgrad hooks (microbatch 0's expert W inside the dispatch all-to-all) between the forward's steps, which issue
all-to-alls and the aux-loss all-reduce; every bucket must still start exactly once, from a hook of the last
microbatch (the pair runs inside the wrapper's ``no_sync()``).
"""

from __future__ import annotations

import threading

import torch
import torch.distributed as dist

import splitgrad
from splitgrad.models import MoEGPT, lm_loss, moe_layers
from splitgrad.parallel.expert import (
    ExpertDataParallel,
    ExpertParallelMoEGPT,
    load_full_state_dict,
    overlapped_forward_backward,
)
from tests.expert.ep_checks import close, full_name, split_grouped, wrap_expert_dp
from tests.helpers import grads
from tests.models.helpers import batch, build, moe_config


def _launched(edp: ExpertDataParallel) -> list[tuple[str, int]]:
    """``(wrapper, bucket)`` of every bucket launch of both wrappers this step so far, in issue order."""
    return [("dense", i) for i in edp.dense.launch_order] + [("expert", i) for i in edp.expert.launch_order]


def overlap_with_expert_dp(
    rank: int,
    world: int,
    ep: int,
    ep_group,
    edp_group,
    experts: str,
    overrides: dict,
    local_b: int = 1,
    seq: int = 8,
) -> dict:
    """Overlapped vs in-order two-microbatch step under ExpertDataParallel (model ``moe_config(**overrides)``);
    returns a small report."""
    config = moe_config(**overrides)
    ref = build(MoEGPT, config)
    ids, targets = batch(config, batch_size=2 * world * local_b, seq=seq)
    per_mb = world * local_b
    # Reference: the two global microbatches one after the other, gradients accumulated.
    for mb in range(2):
        lm_loss(
            ref(ids[mb * per_mb : (mb + 1) * per_mb]), targets[mb * per_mb : (mb + 1) * per_mb]
        ).backward()
    ref_grads = split_grouped(grads(ref), ref)
    mine = [slice(mb * per_mb + rank * local_b, mb * per_mb + (rank + 1) * local_b) for mb in range(2)]

    runs, report = {}, {}
    for overlapped in (False, True):
        model = ExpertParallelMoEGPT(
            moe_config(**overrides, delay_wgrad_compute=True),
            ep_group=ep_group,
            dp_group=dist.group.WORLD,
            experts=experts,
        )
        load_full_state_dict(model, ref.state_dict())
        edp = wrap_expert_dp(model, edp_group)
        hook_threads: list[str] = []
        for layer in moe_layers(model):
            for fc in (layer.fc1, layer.fc2):
                fc.register_wgrad_accumulation_and_reduce_hooks(
                    lambda seen=hook_threads: seen.append(threading.current_thread().name)
                )
        wlog: list = []
        for layer in moe_layers(model):
            layer.wgrad_log = wlog
        if overlapped:  # the bare model under the wrapper is refused before anything runs
            try:
                overlapped_forward_backward(model, ids[mine[1]], torch.zeros((), requires_grad=True))
            except ValueError as exc:
                if "pass the wrapper" not in str(exc):
                    raise
                report["bare_model_refused"] = True
            else:
                raise AssertionError("overlap on the bare model under ExpertDataParallel was accepted")
        edp.zero_grad_buffer()
        x0, t0, x1, t1 = ids[mine[0]], targets[mine[0]], ids[mine[1]], targets[mine[1]]
        loss0 = lm_loss(edp(x0), t0)
        if overlapped:
            logits1 = overlapped_forward_backward(edp, x1, loss0)  # inside edp.no_sync()
            if _launched(edp) or len(wlog) != len(moe_layers(model)):
                raise AssertionError(
                    f"after the pair: launches {_launched(edp)}, expert W in dispatch {len(wlog)}"
                )
            if threading.current_thread().name not in hook_threads:
                raise AssertionError(f"no wgrad hook fired during the pair: {hook_threads}")
        else:
            with edp.no_sync():
                loss0.backward()
            logits1 = edp(x1)
        lm_loss(logits1, t1).backward()
        splitgrad.backward_dw(edp)
        before_finish = _launched(edp)
        edp.finish_grad_sync()
        # Every bucket of both wrappers exactly once, from a hook (before finish_grad_sync): none from the pair,
        # which ran inside the wrapper's no_sync() (checked above), so all from the last microbatch's B / W.
        want = sorted(
            [("dense", b.index) for b in edp.dense.buckets]
            + [("expert", b.index) for b in edp.expert.buckets]
        )
        if sorted(before_finish) != want or len(before_finish) != len(want):
            raise AssertionError(f"{overlapped=}: launches {before_finish}, expected each of {want} once")
        if splitgrad.pending_wgrad(model):
            raise AssertionError("wgrad work left after the step")
        runs[overlapped] = split_grouped(
            {name: p.main_grad.clone() for name, p in model.named_parameters()}, model
        )
        for name, g in runs[overlapped].items():
            close(g, ref_grads[full_name(model, name)], f"{overlapped=} {experts}: {name}")
        edp.close()
        report[overlapped] = {"buckets": len(want), "hook_threads": sorted(set(hook_threads))}
    for name, g in runs[True].items():
        torch.testing.assert_close(g, runs[False][name], rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")
    # Not trivially passing: the reference of microbatch 1 alone (microbatch 0's gradients lost) is rejected.
    ref1 = build(MoEGPT, config)
    lm_loss(ref1(ids[per_mb:]), targets[per_mb:]).backward()
    lost = split_grouped(grads(ref1), ref1)
    try:
        for name, g in runs[True].items():
            close(g, lost[full_name(model, name)], "negative")
    except AssertionError:
        report["negative"] = True
    else:
        raise AssertionError("gradients without microbatch 0 were accepted")
    return report
