"""Where the batch-level MoE overlap loses time: load-independent evidence.

Same setup as ``bench_moe_overlap.py`` (2 gloo ranks, EP = 2, small MoE GPT; the pair "backward of microbatch 0
+ forward of microbatch 1"). Per wgrad mode it reports, rank 0, medians over samples:

* ``cpu seq`` / ``cpu fwd + bwd``: the sequential pair's process CPU time and the overlapped pair's CPU time
  split into the forward's steps and the rest of the backward: the overlap's extra CPU, by part;
* ``ctx sw``: voluntary / involuntary context switches of the thread during the overlapped pair;
* ``threads``: ``torch.get_num_threads()`` and the OS threads the process has;
* ``exchanges``: per pair, how many blocking waits were entered before the peer rank had posted the same
  exchange, and the time spent so (peer late, a cross-rank skew no local reordering removes) vs after both
  posted;
* ``fwd / bwd waits``: the thread's blocking waits (the layers' ``wait_log``) of each part; one thread, so
  nothing computes during any of them (``blocked``).

Timestamps are ``time.perf_counter()`` (CLOCK_MONOTONIC: one clock for both processes of the machine). Run it
inside the rate-limited namespace, e.g.::

    python benchmarks/_netns.py --rate 4gbit -- python benchmarks/diag_moe_overlap.py

(It also diagnosed the retired ``threads`` driver: GIL switch intervals, the OS-scheduled and baton variants;
docs/expert_parallel.md keeps what it found.)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch.distributed as dist

import splitgrad
from splitgrad.models import lm_loss
from splitgrad.parallel.expert import overlapped_forward_backward
from splitgrad.testing import spawn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_moe_overlap import _expert_wgrad, _measure, add_pair_arguments, build_pair_model


def _cross_rank(mine: list, peer: list) -> tuple[int, float, float]:
    """(waits entered before the peer posted, seconds waited for the peer to post, seconds after both posted)
    over the exchanges both logs hold, matched by name and occurrence."""
    seen: dict[str, int] = {}
    peer_by: dict[tuple[str, int], float] = {}
    for name, start, _ in peer:
        peer_by[(name, seen.get(name, 0))] = start
        seen[name] = seen.get(name, 0) + 1
    seen.clear()
    early, late_s, after_s = 0, 0.0, 0.0
    for name, start, end in mine:
        key = (name, seen.get(name, 0))
        seen[name] = key[1] + 1
        if key not in peer_by:
            continue
        posted = max(start, peer_by[key])
        early += peer_by[key] > start
        late_s += posted - start
        after_s += max(end - posted, 0.0)
    return early, late_s, after_s


def _mode(rank: int, world: int, args: argparse.Namespace, delayed: bool) -> dict[str, float]:
    model, group, ids, comm_log, wgrad_log, wait_log = build_pair_model(rank, world, args, delayed)
    rows: dict[str, list[float]] = {}
    for sample in range(args.warmup + args.samples):
        # sequential pair, CPU only
        loss0 = lm_loss(model(ids[0]), ids[0])
        dist.barrier(group)
        cpu = time.process_time()
        loss0.backward()
        if delayed:
            _expert_wgrad(model)
        logits1 = model(ids[1])
        seq_cpu = time.process_time() - cpu
        lm_loss(logits1, ids[1]).backward()
        splitgrad.backward_dw(model)
        model.zero_grad(set_to_none=True)
        # overlapped pair
        loss0 = lm_loss(model(ids[0]), ids[0])
        dist.barrier(group)
        comm_log.clear()
        wgrad_log.clear()
        wait_log.clear()
        stats: dict = {}
        tasks = len(os.listdir("/proc/self/task"))
        logits1 = overlapped_forward_backward(model, ids[1], loss0, thread_stats=stats)
        tasks_after = len(os.listdir("/proc/self/task"))
        log, waits = list(comm_log), list(wait_log)
        lm_loss(logits1, ids[1]).backward()
        splitgrad.backward_dw(model)
        model.zero_grad(set_to_none=True)
        logs: list = [None] * world
        dist.all_gather_object(logs, log, group=group)
        if sample < args.warmup:
            continue
        f, b, p = stats["forward"], stats["backward"], stats["pair"]
        # One thread: its blocking waits are the waits; nothing computes during any of them.
        early, late_s, after_s = _cross_rank(waits, logs[1 - rank])
        forward_waits = [(s, e) for n, s, e in waits if not n.endswith("backward")]
        backward_waits = [(s, e) for n, s, e in waits if n.endswith("backward")]
        values = {
            "cpu seq": seq_cpu, "cpu fwd": f["cpu"], "cpu bwd": b["cpu"], "wall ovl": p["end"] - p["start"],
            "vol": p.get("voluntary", 0), "invol": p.get("involuntary", 0),
            "torch threads": f["num_threads"], "os threads": max(tasks, tasks_after),
            "exchanges": len(log), "early": early, "peer late": late_s, "after posted": after_s,
            "fwd waits": _measure(forward_waits), "bwd waits": _measure(backward_waits),
            "blocked": _measure(forward_waits + backward_waits),
        }  # fmt: skip
        for key, value in values.items():
            rows.setdefault(key, []).append(float(value))
    return {k: statistics.median(v) for k, v in rows.items()}


def rank_main(rank: int, world: int, args: argparse.Namespace) -> dict:
    return {mode: _mode(rank, world, args, mode == "delayed") for mode in args.modes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_pair_arguments(parser)
    parser.add_argument("--modes", type=lambda t: t.split(","), default=["immediate", "delayed"])
    args = parser.parse_args()
    results = spawn(rank_main, 2, args, timeout=1800.0, pg_timeout=600.0)
    print(
        f"tokens/microbatch/rank {args.batch * args.seq}, hidden {args.hidden}, {args.layers} layers; routing "
        f"{'balanced (forced)' if args.balanced_routing else 'learned'}; rank 0 medians"
    )
    print(
        "| wgrad | cpu seq (ms) | cpu fwd + bwd (ms) | ctx sw vol / invol | torch threads, OS "
        "| exchanges, entered before peer posted | peer late / after posted (ms) | fwd / bwd waits (ms) | "
        "blocked (ms) | wall ovl (ms) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for mode, r in results[0].items():
        print(
            f"| {mode} | {r['cpu seq'] * 1e3:.1f} | {r['cpu fwd'] * 1e3:.1f} + {r['cpu bwd'] * 1e3:.1f} | "
            f"{r['vol']:.0f} / {r['invol']:.0f} | {r['torch threads']:.0f}, {r['os threads']:.0f} | "
            f"{r['exchanges']:.0f}, {r['early']:.0f} | {r['peer late'] * 1e3:.1f} / {r['after posted'] * 1e3:.1f} | "
            f"{r['fwd waits'] * 1e3:.1f} / {r['bwd waits'] * 1e3:.1f} | {r['blocked'] * 1e3:.1f} | "
            f"{r['wall ovl'] * 1e3:.1f} |"
        )


if __name__ == "__main__":
    main()
