"""Pipeline schedules on 2 CPU ranks: splitgrad's runtime vs torch.distributed.pipelining, same model and data.

Run: ``.venv/bin/python benchmarks/bench_pipeline.py [--quick]`` (defaults: 4 MLP blocks H=512, FFN 4H, 8
microbatches of 1024 tokens, float32; 2 gloo ranks x 1 thread; about 6 minutes on 2 idle cores).

Variants (``_pipeline_variants.py``), each on 2-D activations ``(tokens, H)`` and again on 3-D ``(batch, seq,
H)``: PyTorch's ``1F1B`` / ``InterleavedZB`` / ``ZBV`` on plain ``nn.Linear`` blocks, its zero-bubble schedules
on ``splitgrad.Linear(delay_wgrad_compute=True)`` blocks through
:func:`splitgrad.pipeline.torch_adapter.splitgrad_pipeline_stage`, splitgrad's runtime with ``1f1b`` /
``zb-h1`` / ``zbv``, and the single-process reference.

1F1B and zb-h1 cut the model into 2 stages of 2 blocks, the interleaved/V schedules into 4 stages of 1.

What is measured, in two 2-rank spawns (every variant in each, run round-robin so drift hits all alike):

* timing spawn (glibc's default allocator): step time = barrier, step, barrier on every rank, median over
  rounds; tokens/s; efficiency = single-process reference / (2 x step time), as the issue defines it, and
  again against ``reference, both ranks at once`` (each rank runs the whole single-process step at the same
  time: the compute speed of two busy cores, so that column isolates bubble and transfers); measured
  bubble ``(span - compute) / span`` of the longest-span rank from per-action timings (splitgrad's timeline;
  PyTorch's stage calls wrapped), as ``splitgrad.pipeline.timeline``; a profile table of per-action medians.
* memory spawn (``MALLOC_MMAP_THRESHOLD_=65536``: every tensor above 64 KiB is its own mapping, returned to
  the OS when freed, so the resident set follows live tensors; it slows allocation, hence the separate
  spawn): step peak per rank = the highest RSS sampled every 2 ms during a step minus the RSS before it,
  plus what the variant keeps from one step to the next (receive buffers, their gradients, caches: measured
  around its first step, and shown as "held"). Also one microbatch through one stage in a single process:
  what PyTorch's own I and splitgrad's B leave alive until W.

The last table reads off issue 13 item 5 in one run: per splitgrad schedule and activation rank, the
measured bubble next to the simulated one at the measured per-stage costs (target: within 0.01), the
throughput over PyTorch's best zero-bubble variant of the same activations (native or through the adapter;
the median over rounds of the per-round ratio; target >= 1.00), and the receive buffers the runtime held
posted ahead (rank 0). Next to it, each step replayed at its own per-action durations
(:func:`splitgrad.pipeline.timeline.replay_measured`: the simulator's engine without the compute jitter a
median-cost simulation cannot see): measured - replay is the runtime's
overhead, split on the longest-span rank into dispatch / transport / propagated ms per step
(:func:`~splitgrad.pipeline.timeline.overhead_split`), and rank 0's runtime CPU per action outside the handlers
(``StepResult.runtime_cpu``). On a shared machine run it in the rate-limited namespace: ``python
benchmarks/_netns.py --rate 4gbit -- .venv/bin/python benchmarks/bench_pipeline.py``; ``--quick`` (tiny
sizes, about a minute) only proves it runs.

``--head-to-head`` runs ``bench_pipeline_head_to_head.py`` instead (splitgrad ``zbv`` against PyTorch's
zero-bubble variants only, paired by round; see there).

The parts: ``_pipeline_variants.py`` (model, data, variants), ``_pipeline_rounds.py`` (the round-robin rounds on
each rank), ``_pipeline_memory.py`` (the RSS sampler, memory from B to W), ``_pipeline_report.py`` (the tables).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import asdict

import bench_pipeline_head_to_head
from _pipeline_report import print_realisation, print_report, summarize
from _pipeline_rounds import run_rank
from _pipeline_variants import DETACH_BUG, TORCH_SCHEDULES, BenchConfig, TorchVariant
from bench_pipeline_head_to_head import QUICK
from splitgrad.testing import SpawnError, spawn


def native_attempt(rank: int, world: int, cfg_fields: dict, schedule: str) -> str:
    """One step of PyTorch's own I/W split on plain blocks with 3-D activations (expected to raise)."""
    TorchVariant(BenchConfig(**cfg_fields), schedule, True, adapter=False, rank=rank).step()
    return "ran"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny smoke configuration (seconds of compute)")
    parser.add_argument("--rounds", type=int, default=None, help="timed steps per variant")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per 2-rank spawn")
    parser.add_argument(
        "--head-to-head",
        action="store_true",
        help="run bench_pipeline_head_to_head.py instead: only splitgrad's V schedules and PyTorch's zero-bubble "
        "variants, timing only, paired throughput table (default 16 rounds)",
    )
    args = parser.parse_args()
    if args.head_to_head:
        bench_pipeline_head_to_head.run(quick=args.quick, rounds=args.rounds, timeout=args.timeout)
        return
    cfg = BenchConfig(**(QUICK if args.quick else {}))
    if args.rounds is not None:
        cfg.rounds = args.rounds
    native: dict[str, str] = {}
    for name in TORCH_SCHEDULES[1:]:
        try:
            spawn(native_attempt, 2, asdict(cfg), name, timeout=300, pg_timeout=60)
            native[name] = "ran"
        except SpawnError as exc:
            text = str(exc) + "".join(f.traceback + f.message for f in exc.failures)
            native[name] = (
                f"fails: {DETACH_BUG}" if DETACH_BUG in text else f"fails: {exc.failures[0].message[:80]}"
            )
    load = [tuple(round(v, 1) for v in os.getloadavg())]
    os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
    timing = spawn(run_rank, 2, asdict(cfg), False, timeout=args.timeout, pg_timeout=600)
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # read by the ranks' malloc at start-up
    memory = spawn(run_rank, 2, asdict(cfg), True, timeout=args.timeout, pg_timeout=600)
    load.append(tuple(round(v, 1) for v in os.getloadavg()))
    rows = summarize(cfg, timing, memory)
    print_report(cfg, rows, native, memory[0]["b_to_w"], load)
    print_realisation(rows)


if __name__ == "__main__":
    main()
