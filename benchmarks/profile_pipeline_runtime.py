"""The pipeline runtime's own CPU per action, measured load-independently on 2 gloo ranks with tiny tensors.

Run: ``.venv/bin/python benchmarks/profile_pipeline_runtime.py [--schedules 1f1b zb-h1 zbv] [--steps 20]
[--cprofile] [--bench-model]`` (``--bench-model``: ``bench_pipeline.py``'s model and data instead, where the
same figure includes what large messages and cold caches add).

With 8 x 8 blocks the actions' compute is small, so what is left is the interpreter: posting and completing
messages, the loop, timeline bookkeeping. Every figure is this rank's *thread CPU time*
(``time.thread_time``): a blocking wait uses none, and other processes on the machine do not add to it, so the
numbers hold on a loaded machine (``StepResult.runtime_cpu`` is the runtime's CPU outside its actions'
handlers, ``StepResult.action_cpu`` the CPU inside them). ``--cprofile`` adds rank 0's top functions by CPU
time (``cProfile`` with a thread-CPU clock) for the last steps.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time

import torch.nn.functional as F

from _pipeline_variants import BenchConfig, batch, cut
from splitgrad.pipeline.runtime import build_runtime
from splitgrad.testing import spawn


def run_rank(rank: int, world: int, schedule: str, steps: int, profile: bool, bench_model: bool) -> dict:
    cfg = BenchConfig() if bench_model else BenchConfig(hidden=8, ffn=8, tokens=8, seq=4, n_microbatches=8)
    n_stages = 4 if schedule.startswith("zbv") else 2
    rt = build_runtime(
        cut(cfg, True, n_stages), schedule, loss_fn=F.mse_loss, n_microbatches=cfg.n_microbatches
    )
    x, y = batch(cfg, False)
    for _ in range(2):  # warm-up: shape headers, lazy allocations
        rt.step(x, y)
        rt.zero_grad()
    runtime, action = [], []
    profiler = cProfile.Profile(time.thread_time) if profile and rank == 0 else None
    for _ in range(steps):
        if profiler is not None:
            profiler.enable()
        result = rt.step(x, y)
        if profiler is not None:
            profiler.disable()
        rt.zero_grad()
        runtime.append(result.runtime_cpu / len(rt.actions))
        action.append(result.action_cpu / len(rt.actions))
    rt.close()
    out = {"actions": len(rt.actions), "runtime": runtime, "action": action}
    if profiler is not None:
        text = io.StringIO()
        stats = pstats.Stats(profiler, stream=text)
        stats.sort_stats("tottime").print_stats(25)
        # What the interpreter loop itself calls, apart from the handlers.
        stats.sort_stats("cumulative").print_callees(r"runtime.py.*\(_run\)")
        out["profile"] = text.getvalue()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedules", nargs="+", default=["1f1b", "zb-h1", "zbv"])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--cprofile", action="store_true", help="rank 0's top functions by CPU time")
    parser.add_argument("--bench-model", action="store_true", help="bench_pipeline.py's model and data")
    args = parser.parse_args()
    print(
        "| schedule | actions per rank | runtime CPU per action, r0 / r1 (us) | handler CPU per action (us) |"
    )
    print("|---|---:|---:|---:|")
    profiles = []
    for name in args.schedules:
        ranks = spawn(
            run_rank, 2, name, args.steps, args.cprofile, args.bench_model, timeout=1800, pg_timeout=600
        )
        runtime = " / ".join(f"{1e6 * statistics.median(r['runtime']):.0f}" for r in ranks)
        action = " / ".join(f"{1e6 * statistics.median(r['action']):.0f}" for r in ranks)
        print(f"| {name} | {ranks[0]['actions']} | {runtime} | {action} |")
        if "profile" in ranks[0]:
            profiles.append((name, ranks[0]["profile"]))
    for name, text in profiles:
        print(f"\n{name}, rank 0, {args.steps} steps (cProfile, thread CPU time):\n{text}")


if __name__ == "__main__":
    main()
