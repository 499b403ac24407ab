"""Batch-level overlap of an expert-parallel MoE model: all-to-all time hidden by the other microbatch.

2 gloo ranks, EP = 2, a small MoE GPT; per sample, with microbatch 0's forward done, it times the pair
"backward of microbatch 0 + forward of microbatch 1" run in order and run overlapped
(:func:`splitgrad.parallel.expert.overlapped_forward_backward`: one thread stepping the forward at each backward
exchange), round-robin, and the all-to-alls of that pair alone (the same split sizes, no compute). Two wgrad
modes, a row each:

* ``immediate``: weight gradients inside the backward;
* ``delayed``: deferred wgrad; the pair includes microbatch 0's *expert* weight gradients, run after its backward
  in the sequential order and inside each layer's backward dispatch all-to-all in the overlapped order
  (Megatron-Core's ``--delay-wgrad-compute``); the dense W runs after the pair in both, untimed.

Reported (rank 0, medians):

* ``comm alone``: the pair's dispatch/combine exchanges (forward of one microbatch + backward of the other),
  one after the other with nothing else running; ``comm CPU``: this process's CPU time meanwhile (gloo's
  threads, the kernel's socket copies charged to them). That CPU needs the core the compute runs on, so on
  this box at most ``hideable = (comm - comm CPU) / comm`` can vanish behind compute (an accelerator's
  transfers would not take it from the compute);
* ``sequential`` / ``overlapped``: the pair's wall time, and its CPU time (load-independent);
* ``hidden = (sequential - overlapped) / comm alone``, per sample (the sample's sequential and overlapped pair
  ran back to back and its exchanges right after) and the median of those, with its quartiles; next to the
  most the compute could cover, ``coverable = min(comm, sequential - comm) / comm`` (of the medians);
* ``waits covered by order``: of the time the overlapped pair's exchanges were in flight, the fraction during
  which the thread was not blocked in a wait (it computed the other part), from the process's own timestamps:
  an event-order figure that a loaded machine distorts much less than wall times.

Communication must take wall time, not CPU, for overlap to be visible: run it inside a rate-limited namespace::

    python benchmarks/_netns.py --rate 1gbit -- python benchmarks/bench_moe_overlap.py
    python benchmarks/_netns.py --rate 4gbit -- python benchmarks/bench_moe_overlap.py

(The retired ``threads`` driver of ``overlapped_forward_backward`` had rows here too; docs/expert_parallel.md
keeps its last measurements.)
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

import splitgrad
from _timing import quartiles
from splitgrad.models import MoEConfig, MoEGPT, lm_loss
from splitgrad.parallel.expert import ExpertParallelMoEGPT, ExpertParallelMoEMLP, overlapped_forward_backward
from splitgrad.parallel.expert.dispatch_wgrad import run_expert_wgrad
from splitgrad.testing import spawn


def _pair_exchanges(model: MoEGPT, group: dist.ProcessGroup) -> list[tuple[list[int], list[int], int]]:
    """(in_splits, out_splits, width) of every dispatch/combine of one forward and one backward, from the
    layers' last forward (the microbatches have the same size, so this is what the pair exchanges)."""
    out = []
    for layer in (m for m in model.modules() if isinstance(m, ExpertParallelMoEMLP)):
        sends, recvs = layer.last_dispatch_splits
        width = layer.norm.weight.shape[0]
        out += [(sends, recvs, width), (recvs, sends, width)] * 2
    return out


def _comm_alone(exchanges, group) -> tuple[float, float]:
    """(wall, CPU) seconds of ``exchanges`` one after the other, nothing else running. The buffers are made
    first: filling 8 x 4 MiB with ``randn`` inside the timed loop once added ~50 ms of compute to "comm"."""
    buffers = [(torch.randn(sum(s), w), torch.empty(sum(r), w)) for s, r, w in exchanges]
    dist.barrier(group)
    start, cpu = time.perf_counter(), time.process_time()
    for (sends, recvs, _), (x, out) in zip(exchanges, buffers, strict=True):
        dist.all_to_all_single(out, x, recvs, sends, group=group)
    return time.perf_counter() - start, time.process_time() - cpu


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def _minus(intervals, holes) -> list[tuple[float, float]]:
    """``intervals`` without the parts covered by ``holes`` (both lists of ``(start, end)``)."""
    out = []
    for start, end in _union(intervals):
        cursor = start
        for hs, he in _union(holes):
            if he <= cursor or hs >= end:
                continue
            if hs > cursor:
                out.append((cursor, hs))
            cursor = max(cursor, he)
        if cursor < end:
            out.append((cursor, end))
    return out


def _measure(intervals) -> float:
    return sum(end - start for start, end in _union(intervals))


def _covered_by_steps(comm_log: list, wait_log: list) -> float:
    """Of the time the pair's exchanges were in flight (issue to wait end), the fraction during which the thread
    was not blocked in a wait (it computed the other part meanwhile)."""
    in_flight = [(s, e) for name, s, e in comm_log if name != "dispatch counts"]
    total = _measure(in_flight)
    if total == 0:
        return float("nan")
    blocked = _measure(_minus(in_flight, _minus(in_flight, [(s, e) for _, s, e in wait_log])))
    return 1.0 - blocked / total


def _expert_wgrad(model: MoEGPT) -> None:
    """Microbatch 0's deferred expert W, run right after its backward (the sequential order's placement)."""
    for layer in (m for m in model.modules() if isinstance(m, ExpertParallelMoEMLP)):
        run_expert_wgrad([layer.fc1, layer.fc2])


def build_pair_model(rank: int, world: int, args: argparse.Namespace, delayed: bool) -> tuple:
    """``(model, group, ids, comm_log, wgrad_log, wait_log)``: the EP MoE GPT both MoE scripts time, two
    microbatches ``(batch, seq)`` of this rank's ids, and the lists its MoE layers log exchanges / expert W /
    blocking waits into."""
    torch.manual_seed(0)
    group = dist.new_group(list(range(world)))
    config = MoEConfig(
        vocab_size=256, seq_len=args.seq, hidden_size=args.hidden, num_layers=args.layers, num_heads=8,
        ffn_hidden_size=4 * args.hidden, moe_ffn_hidden_size=2 * args.hidden, num_experts=4, top_k=2,
        delay_wgrad_compute=delayed, router_force_load_balancing=args.balanced_routing,
    )  # fmt: skip
    model = ExpertParallelMoEGPT(config, ep_group=group)
    gen = torch.Generator().manual_seed(rank)
    ids = [torch.randint(0, 256, (args.batch, args.seq), generator=gen) for _ in range(2)]
    comm_log: list = []
    wgrad_log: list = []
    wait_log: list = []
    for layer in (m for m in model.modules() if isinstance(m, ExpertParallelMoEMLP)):
        layer.comm_log, layer.wgrad_log, layer.wait_log = comm_log, wgrad_log, wait_log
    return model, group, ids, comm_log, wgrad_log, wait_log


def _mode(rank: int, world: int, args: argparse.Namespace, delayed: bool) -> dict[str, float]:
    model, group, ids, comm_log, wgrad_log, wait_log = build_pair_model(rank, world, args, delayed)
    variants = ["sequential", "overlapped"]
    timings: dict[str, list[float]] = {"comm alone": [], "comm cpu": []}
    for sample in range(args.warmup + args.samples):
        for variant in variants:
            loss0 = lm_loss(model(ids[0]), ids[0])
            dist.barrier(group)
            comm_log.clear()
            wgrad_log.clear()
            wait_log.clear()
            start, cpu = time.perf_counter(), time.process_time()
            if variant == "overlapped":
                logits1 = overlapped_forward_backward(model, ids[1], loss0)
            else:
                loss0.backward()
                if delayed:
                    _expert_wgrad(model)
                logits1 = model(ids[1])
            elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
            if variant == "overlapped" and sample >= args.warmup:
                covered = _covered_by_steps(list(comm_log), list(wait_log))
                timings.setdefault("covered by order", []).append(covered)
            lm_loss(logits1, ids[1]).backward()
            splitgrad.backward_dw(model)
            model.zero_grad(set_to_none=True)
            if sample >= args.warmup:
                timings.setdefault(variant, []).append(elapsed)
                timings.setdefault(f"{variant} cpu", []).append(cpu)
        if sample >= args.warmup:
            wall, cpu = _comm_alone(_pair_exchanges(model, group), group)
            timings["comm alone"].append(wall)
            timings["comm cpu"].append(cpu)
    out = {k: statistics.median(v) for k, v in timings.items()}
    # Each sample's sequential and overlapped pair ran back to back, its exchanges right after.
    out["hidden"], out["hidden q"] = paired_hidden(
        timings["sequential"], timings["overlapped"], timings["comm alone"]
    )
    return out


def paired_hidden(
    plain: list[float], overlapped: list[float], comm: list[float]
) -> tuple[float, tuple[float, float]]:
    """The hidden fraction of the communication per sample, ``(plain - overlapped) / comm``: its median and
    quartiles. Paired per sample (each sample's runs ran back to back), so drift and load spikes between
    samples cancel, where a ratio of medians would mix them."""
    hidden = [(p - o) / c for p, o, c in zip(plain, overlapped, comm, strict=True)]
    return statistics.median(hidden), quartiles(hidden)


def rank_main(rank: int, world: int, args: argparse.Namespace) -> dict[str, dict[str, float]]:
    return {mode: _mode(rank, world, args, mode == "delayed") for mode in args.modes}


def add_pair_arguments(parser: argparse.ArgumentParser) -> None:
    """The model and sampling options this script and ``diag_moe_overlap.py`` share."""
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument(
        "--balanced-routing",
        action="store_true",
        help="route round-robin (MoEConfig.router_force_load_balancing): every expert, hence every rank, gets the "
        "same number of token copies; without it the learned router loads the ranks unevenly",
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_pair_arguments(parser)
    parser.add_argument(
        "--modes",
        type=lambda text: [m.strip() for m in text.split(",") if m.strip()],
        default=["immediate", "delayed"],
        help="comma-separated wgrad modes, each a row: immediate, delayed (expert W inside the dispatch)",
    )
    parser.add_argument("--delayed", action="store_true", help="only the delayed mode (--modes delayed)")
    args = parser.parse_args()
    if args.delayed:
        args.modes = ["delayed"]
    bad = [m for m in args.modes if m not in ("immediate", "delayed")]
    if bad or not args.modes:
        parser.error(f"--modes: choose from immediate, delayed; got {args.modes}")
    results = spawn(rank_main, 2, args, timeout=1800.0, pg_timeout=600.0)
    print(
        f"tokens per microbatch per rank {args.batch * args.seq}, hidden {args.hidden}, {args.layers} MoE layers; "
        f"routing {'balanced (forced)' if args.balanced_routing else 'learned'}; rank 0 medians"
    )
    print(
        "| wgrad | comm alone (ms) | comm CPU (ms) | sequential pair (ms) | overlapped pair (ms) | speed-up "
        "| A2A hidden | (quartiles) | coverable | hideable | pair CPU seq / ovl (ms) | waits covered by order |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for mode in args.modes:
        r = results[0][mode]
        comm, seq = r["comm alone"], r["sequential"]
        coverable = min(comm, max(seq - comm, 0.0)) / comm
        hideable = max(comm - r["comm cpu"], 0.0) / comm
        ovl = r["overlapped"]
        print(
            f"| {mode} | {comm * 1e3:.1f} | {r['comm cpu'] * 1e3:.1f} | {seq * 1e3:.1f} | {ovl * 1e3:.1f} "
            f"| {seq / ovl:.3f} | {r['hidden']:.0%} | [{r['hidden q'][0]:.0%}, {r['hidden q'][1]:.0%}] | "
            f"{coverable:.0%} | {hideable:.0%} | {r['sequential cpu'] * 1e3:.1f} / "
            f"{r['overlapped cpu'] * 1e3:.1f} | {r['covered by order']:.0%} |"
        )


if __name__ == "__main__":
    main()
