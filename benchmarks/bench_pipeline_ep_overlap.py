"""Expert all-to-all hidden by Megatron's combined 1F1B across virtual pipeline stages (pp = 2 x ep = 2).

4 gloo ranks: two pipeline replicas of 2 ranks, expert-parallel groups across them (``{0, 2}``, ``{1, 3}``).
An EP MoE GPT cut into 4 stages, two per rank (``interleaved-1f1b``, Megatron's virtual pipeline). Per sample,
round-robin, one step of each:

* ``plain``: ``interleaved-1f1b`` as is (forward, then backward; no pairs);
* ``pairs``: ``interleaved-1f1b`` with ``overlap=True`` (Megatron-Core's combined 1F1B: one more warm-up
  forward, then forward ``k + w`` with backward ``k`` as one unit) on :class:`OverlappedMoEStage` stages, so the
  backward part's exchanges advance the forward part (and, with delayed wgrad, each layer's expert W runs
  inside its backward dispatch).

From each rank's timeline: the time the paired work took in the ``plain`` step (the ``F`` and ``BW`` actions
that the ``pairs`` schedule fuses) and in the ``pairs`` step (its ``F+B`` units), and, right after, the
all-to-alls of those units alone (the same split sizes, nothing else running, all ranks at once as in the
step). ``A2A hidden = (paired plain - paired pairs) / a2a alone``, per sample, median; the step times too.
Warm-up and cool-down units are not paired in either order, so they are left out of both.

Communication must take wall time, not CPU, for overlap to show: run it in the rate-limited namespace::

    python benchmarks/_netns.py --rate 1gbit -- python benchmarks/bench_pipeline_ep_overlap.py
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from bench_moe_overlap import _comm_alone, _pair_exchanges, paired_hidden
from splitgrad.models import MoEConfig, lm_loss, split_into_stages
from splitgrad.parallel.expert import (
    ExpertParallelMoEGPT,
    OverlappedMoEStage,
    set_wgrad_in_dispatch,
)
from splitgrad.pipeline import build_schedule
from splitgrad.pipeline.ir.actions import OverlapAction
from splitgrad.pipeline.runtime import build_runtime, pipeline_groups
from splitgrad.testing import spawn

PP, EP, V = 2, 2, 2  # pipeline ranks, expert-parallel size, stages per rank


def _durations(events) -> dict[str, float]:
    return {e.name: e.end - e.start for e in events if e.is_compute}


def _mode(rank: int, args: argparse.Namespace, delayed: bool, groups) -> dict:
    torch.manual_seed(0)
    ep_group = groups.dp_group  # the same stage in both replicas
    config = MoEConfig(
        vocab_size=256, seq_len=args.seq, hidden_size=args.hidden, num_layers=PP * V * args.layers, num_heads=8,
        ffn_hidden_size=4 * args.hidden, moe_ffn_hidden_size=2 * args.hidden, num_experts=4, top_k=2,
        delay_wgrad_compute=delayed, router_force_load_balancing=args.balanced_routing,
    )  # fmt: skip
    model = ExpertParallelMoEGPT(config, ep_group=ep_group, dp_group=ep_group)
    stages = split_into_stages(model, PP * V)
    plain = build_schedule("interleaved-1f1b", PP * V, args.microbatches)
    fused = build_schedule("interleaved-1f1b", PP * V, args.microbatches, overlap=True)
    runtimes = {
        "plain": build_runtime(stages, plain, loss_fn=lm_loss, pp_group=groups.pp_group, timeout=600),
        "pairs": build_runtime(
            [OverlappedMoEStage(s, wgrad_in_dispatch=None) for s in stages],
            fused,
            loss_fn=lm_loss,
            pp_group=groups.pp_group,
            timeout=600,
        ),
    }
    pairs = [a for a in fused.rank_actions[groups.pp_rank] if type(a) is OverlapAction]
    gen = torch.Generator().manual_seed(groups.dp_rank)
    n = args.batch * args.microbatches
    ids = torch.randint(0, 256, (n, args.seq), generator=gen)
    local_stage = next(iter(runtimes["plain"].stages.values()))
    timings: dict[str, list[float]] = {}
    for sample in range(args.warmup + args.samples):
        paired = {}
        for mode, rt in runtimes.items():
            # Expert W inside the dispatch only for the pairs (the plain step runs it in its BW bundle).
            set_wgrad_in_dispatch(model, mode == "pairs" and delayed)
            dist.barrier()
            start = time.perf_counter()
            result = rt.step(ids, ids)
            elapsed = time.perf_counter() - start
            rt.zero_grad()
            took = _durations(result.events)
            if mode == "pairs":
                paired[mode] = sum(took[a.name] for a in pairs)
            else:
                paired[mode] = sum(took[a.forward.name] + took[a.backward.name] for a in pairs)
            if sample >= args.warmup:
                timings.setdefault(f"{mode} step", []).append(elapsed)
                timings.setdefault(f"{mode} paired", []).append(paired[mode])
        dist.barrier()
        # The exchanges of one F+B unit alone (F of one stage, B of another: the same layer count and, with
        # balanced routing, the same split sizes), every rank at once as in the step; times the pair count.
        wall, _cpu = _comm_alone(_pair_exchanges(local_stage, ep_group), ep_group)
        if sample >= args.warmup:
            timings.setdefault("a2a alone", []).append(wall * len(pairs))
    out = {k: statistics.median(v) for k, v in timings.items()}
    out["hidden"], out["hidden q"] = paired_hidden(
        timings["plain paired"], timings["pairs paired"], timings["a2a alone"]
    )
    out["pairs"] = len(pairs)
    for rt in runtimes.values():
        rt.close()
    return out


def rank_main(rank: int, world: int, args: argparse.Namespace) -> dict:
    groups = pipeline_groups(pp_size=PP, dp_size=EP)
    return {mode: _mode(rank, args, mode == "delayed", groups) for mode in args.modes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=1, help="MoE layers per stage (4 stages)")
    parser.add_argument("--batch", type=int, default=2, help="sequences per microbatch per replica")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--samples", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--balanced-routing", action="store_true", help="round-robin routing: equal splits")
    parser.add_argument(
        "--modes",
        type=lambda text: [m.strip() for m in text.split(",") if m.strip()],
        default=["immediate", "delayed"],
        help="comma-separated wgrad modes: immediate, delayed",
    )
    args = parser.parse_args()
    bad = [m for m in args.modes if m not in ("immediate", "delayed")]
    if bad or not args.modes:
        parser.error(f"--modes: choose from immediate, delayed; got {args.modes}")
    results = spawn(rank_main, PP * EP, args, timeout=3600.0, pg_timeout=900.0)
    print(
        f"pp {PP} x ep {EP}, {V} stages per rank, {args.layers} MoE layer(s) per stage, hidden {args.hidden}, "
        f"{args.batch * args.seq} tokens per microbatch per replica, {args.microbatches} microbatches; routing "
        f"{'balanced' if args.balanced_routing else 'learned'}; medians over {args.samples} samples"
    )
    print(
        "| wgrad | pp rank | pairs | plain step (ms) | pairs step (ms) | step speed-up | paired plain (ms) "
        "| paired pairs (ms) | a2a alone (ms) | A2A hidden | (quartiles) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for mode in args.modes:
        for pp_rank in range(PP):
            r = results[pp_rank][mode]  # replica 0
            print(
                f"| {mode} | {pp_rank} | {r['pairs']} | {r['plain step'] * 1e3:.1f} | {r['pairs step'] * 1e3:.1f} "
                f"| {r['plain step'] / r['pairs step']:.3f} | {r['plain paired'] * 1e3:.1f} "
                f"| {r['pairs paired'] * 1e3:.1f} | {r['a2a alone'] * 1e3:.1f} | {r['hidden']:.0%} "
                f"| [{r['hidden q'][0]:.0%}, {r['hidden q'][1]:.0%}] |"
            )


if __name__ == "__main__":
    main()
