"""Where the batch-level MoE overlap loses time: load-independent, per-thread evidence.

Same setup as ``bench_moe_overlap.py`` (2 gloo ranks, EP = 2, small MoE GPT; the pair "backward of microbatch 0
+ forward of microbatch 1"). Per wgrad mode and GIL switch interval it reports, rank 0, medians over samples:

* ``cpu seq`` / ``cpu fwd + bwd``: the sequential pair's process CPU time and the overlapped pair's per-thread
  CPU times (``time.thread_time`` of the forward and of the backward thread): the overlap's extra CPU, by thread;
* ``ctx sw``: voluntary / involuntary context switches of both threads in the overlapped pair (and, with the
  ``baton`` variant, ``exclusive_compute=True``, how many waits handed the core to the other part);
* ``threads``: ``torch.get_num_threads()`` seen by each thread and the OS threads the process has;
* ``exchanges``: per pair, how many waits were entered before the peer rank had posted the same exchange, and
  the time spent so (peer late, a cross-rank skew no local reordering removes) vs after both posted;
* ``both waiting``: time during which both parts waited at once (nothing to compute on this rank: exposed).

``--driver threads,steps`` adds rows for the single-thread steps driver (``overlapped_forward_backward(...,
driver="steps")``; GIL interval and baton variants do not apply to it: one row per wgrad mode). There the
forward's CPU is the time spent in its steps and the backward's the rest; context switches are the one thread's;
the waits are the thread's blocking waits (the layers' ``wait_log``), so ``both waiting`` is every blocked
moment (one thread: nothing computes while it waits), and the cross-rank split of the waits uses the blocking
waits against the peer's issue times.

Timestamps are ``time.perf_counter()`` (CLOCK_MONOTONIC: one clock for both processes of the machine). Run it
inside the rate-limited namespace, e.g.::

    python benchmarks/_netns.py --rate 4gbit -- python benchmarks/diag_moe_overlap.py
    python benchmarks/_netns.py --rate 4gbit -- python benchmarks/diag_moe_overlap.py --driver threads,steps
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
from bench_moe_overlap import (
    _expert_wgrad,
    _measure,
    _minus,
    add_pair_arguments,
    build_pair_model,
    check_drivers,
)


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


def _mode(
    rank: int, world: int, args: argparse.Namespace, delayed: bool, interval: float, variant: str
) -> dict[str, float]:
    exclusive, driver = variant == "baton", "steps" if variant == "steps" else "threads"
    model, fwd, ids, comm_log, wgrad_log, wait_log = build_pair_model(rank, world, args, delayed)
    rows: dict[str, list[float]] = {}
    old = sys.getswitchinterval()
    for sample in range(args.warmup + args.samples):
        # sequential pair, CPU only
        loss0 = lm_loss(model(ids[0]), ids[0])
        dist.barrier(fwd)
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
        dist.barrier(fwd)
        comm_log.clear()
        wgrad_log.clear()
        wait_log.clear()
        stats: dict = {}
        tasks = len(os.listdir("/proc/self/task"))
        sys.setswitchinterval(interval)
        try:
            logits1 = overlapped_forward_backward(
                model, ids[1], loss0, thread_stats=stats, exclusive_compute=exclusive, driver=driver
            )
        finally:
            sys.setswitchinterval(old)
        tasks_after = len(os.listdir("/proc/self/task"))
        log, waits = list(comm_log), list(wait_log)
        lm_loss(logits1, ids[1]).backward()
        splitgrad.backward_dw(model)
        model.zero_grad(set_to_none=True)
        logs: list = [None] * world
        dist.all_gather_object(logs, log, group=fwd)
        if sample < args.warmup:
            continue
        f, b = stats["forward"], stats["backward"]
        if driver == "steps":
            # One thread: its blocking waits are the waits; nothing computes during any of them.
            early, late_s, after_s = _cross_rank(waits, logs[1 - rank])
            forward_waits = [(s, e) for n, s, e in waits if not n.endswith("backward")]
            backward_waits = [(s, e) for n, s, e in waits if n.endswith("backward")]
            both = _measure(forward_waits + backward_waits)
            p = stats["pair"]
            wall, switches = p["end"] - p["start"], (p.get("voluntary", 0), p.get("involuntary", 0))
        else:
            early, late_s, after_s = _cross_rank(log, logs[1 - rank])
            # Compute inside a logged wait is not waiting: the expert W in the dispatch backward, and (baton) the
            # wait to take the baton back while the other part computes.
            busy = [(s, e) for _, s, e in wgrad_log] + list(stats.get("baton_waits", []))
            forward_waits = _minus([(s, e) for n, s, e in log if not n.endswith("backward")], busy)
            backward_waits = _minus([(s, e) for n, s, e in log if n.endswith("backward")], busy)
            both = _measure(_minus(forward_waits, _minus(forward_waits, backward_waits)))
            wall = max(f["end"], b["end"]) - f["start"]
            switches = (
                f.get("voluntary", 0) + b.get("voluntary", 0),
                f.get("involuntary", 0) + b.get("involuntary", 0),
            )
        values = {
            "cpu seq": seq_cpu, "cpu fwd": f["cpu"], "cpu bwd": b["cpu"], "wall ovl": wall,
            "vol": switches[0], "invol": switches[1],
            "threads fwd": f["num_threads"], "threads bwd": b["num_threads"], "os threads": max(tasks, tasks_after),
            "exchanges": len(log), "early": early, "peer late": late_s, "after posted": after_s, "both waiting": both,
            "fwd waits": _measure(forward_waits), "bwd waits": _measure(backward_waits),
            "handoffs": stats.get("handoffs", 0), "baton": _measure(stats.get("baton_waits", [])),
        }  # fmt: skip
        for key, value in values.items():
            rows.setdefault(key, []).append(float(value))
    return {k: statistics.median(v) for k, v in rows.items()}


def rank_main(rank: int, world: int, args: argparse.Namespace) -> dict:
    runs = []
    for mode in args.modes:
        if "threads" in args.drivers:
            runs += [(mode, interval, variant) for interval in args.intervals for variant in args.variants]
        if "steps" in args.drivers:
            runs.append((mode, sys.getswitchinterval(), "steps"))
    return {run: _mode(rank, world, args, run[0] == "delayed", run[1], run[2]) for run in runs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_pair_arguments(
        parser,
        "comma-separated overlapped_forward_backward drivers: threads (rows per interval and variant), steps",
    )
    parser.add_argument("--modes", type=lambda t: t.split(","), default=["immediate", "delayed"])
    parser.add_argument(
        "--intervals",
        type=lambda t: [float(v) for v in t.split(",")],
        default=[sys.getswitchinterval()],
        help="GIL switch intervals (seconds) set during the overlapped pair, e.g. 0.005,0.0005",
    )
    parser.add_argument(
        "--variants",
        type=lambda t: t.split(","),
        default=["os", "baton"],
        help="threads driver: os: the OS time-slices the two parts; baton: exclusive_compute=True (parts switch at waits)",
    )
    args = parser.parse_args()
    check_drivers(parser, args)
    results = spawn(rank_main, 2, args, timeout=1800.0, pg_timeout=600.0)
    print(
        f"tokens/microbatch/rank {args.batch * args.seq}, hidden {args.hidden}, {args.layers} layers; routing "
        f"{'balanced (forced)' if args.balanced_routing else 'learned'}; rank 0 medians"
    )
    print(
        "| wgrad | switch (ms) | threads | cpu seq (ms) | cpu fwd + bwd (ms) | ctx sw vol / invol | torch threads fwd/bwd, OS "
        "| exchanges, entered before peer posted | peer late / after posted (ms) | fwd / bwd waits (ms) | "
        "both waiting (ms) | wall ovl (ms), of it waiting for the baton |"
    )
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for (mode, interval, variant), r in results[0].items():
        print(
            f"| {mode} | {interval * 1e3:.1f} | {variant} | {r['cpu seq'] * 1e3:.1f} | {r['cpu fwd'] * 1e3:.1f} + "
            f"{r['cpu bwd'] * 1e3:.1f} | {r['vol']:.0f} / {r['invol']:.0f} ({r['handoffs']:.0f} handoffs) | {r['threads fwd']:.0f}/"
            f"{r['threads bwd']:.0f}, {r['os threads']:.0f} | {r['exchanges']:.0f}, {r['early']:.0f} | "
            f"{r['peer late'] * 1e3:.1f} / {r['after posted'] * 1e3:.1f} | {r['fwd waits'] * 1e3:.1f} / "
            f"{r['bwd waits'] * 1e3:.1f} | {r['both waiting'] * 1e3:.1f} | {r['wall ovl'] * 1e3:.1f}, "
            f"{r['baton'] * 1e3:.1f} |"
        )


if __name__ == "__main__":
    main()
