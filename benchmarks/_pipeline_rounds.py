"""The measured rounds of the pipeline benchmarks: every variant once per round, round-robin, on each rank.

One call of :func:`run_rank` per rank of a 2-rank spawn: timing (step time between two barriers, the merged
events, the simulated bubble at the measured costs, the replay and overhead split) or, with ``memory``, the
step's resident-set peak and what a variant holds between steps.
"""

from __future__ import annotations

import time

import torch.distributed as dist

from _pipeline_memory import RssSampler, b_to_w_memory
from _pipeline_variants import BenchConfig, ReferenceVariant, SplitgradVariant, build_variants
from splitgrad.pipeline.runtime.recording import gather_events
from splitgrad.pipeline.timeline import TimelineEvent, overhead_split, replay_measured, simulate_measured


def run_rank(rank: int, world: int, cfg_fields: dict, memory: bool, head_to_head: bool = False) -> dict:
    """Every variant (``head_to_head``: see :func:`build_variants`), round-robin, each round starting one
    variant later (no variant always runs right after the same neighbour); ``memory``: sample RSS (1 measured
    step) instead of timing."""
    cfg = BenchConfig(**cfg_fields)
    sampler = RssSampler() if memory else None
    b_to_w = b_to_w_memory(cfg) if memory and rank == 0 else None
    if memory:  # one-off lazy allocations (thread pools, BLAS buffers) must not count as a variant's "held"
        ReferenceVariant(cfg, False, rank=rank, both=True).step()
    variants = build_variants(cfg, rank, head_to_head)
    held: dict[str, int] = {}
    samples: dict[str, list[tuple]] = {k: [] for k in variants}
    keys = list(variants)
    try:
        for round_no in range(cfg.warmup + (1 if memory else cfg.rounds)):
            shift = round_no % len(keys)
            for key in keys[shift:] + keys[:shift]:
                variant = variants[key]
                variant.zero_grad()
                dist.barrier()
                base = sampler.reset() if sampler else 0
                start = time.perf_counter()
                events = variant.step()
                dist.barrier()
                elapsed = time.perf_counter() - start
                if sampler and round_no == 0:
                    variant.zero_grad()
                    held[key] = max(sampler.rss() - base, 0)
                if round_no < cfg.warmup:
                    continue
                if sampler:
                    samples[key].append(max(sampler.peak - base, 0) + held[key])
                    continue
                merged = gather_events(events, dst=0)
                simulated, recv_peak, realised = None, None, None
                if isinstance(variant, SplitgradVariant):
                    recv_peak = variant.recv_peak
                    if merged:
                        simulated = simulate_measured(merged, variant.schedule).bubble_ratio
                        realised = realisation(merged, variant.schedule, variant.runtime_cpu)
                samples[key].append((elapsed, merged, simulated, recv_peak, realised))
    finally:
        if sampler:
            sampler.close()
    return {"samples": samples, "held": held, "b_to_w": b_to_w}


def realisation(events: list[TimelineEvent], schedule, runtime_cpu: float) -> dict[str, float]:
    """One step replayed at its own per-action durations, and the longest-span rank's overhead split (ms).

    ``runtime_cpu``: rank 0's CPU seconds per action outside the handlers (``StepResult.runtime_cpu``).
    """
    replay = replay_measured(events, schedule)
    split = overhead_split(events, schedule, replay)
    critical = max(range(len(split)), key=lambda r: split[r].span)
    worst = split[critical]
    return {
        "replay": replay.bubble_ratio,
        "rank": critical,
        "dispatch": 1e3 * worst.dispatch,
        "transport": 1e3 * worst.transport,
        "propagated": 1e3 * worst.propagated,
        "overhead": 1e3 * worst.overhead,
        "cpu_us": 1e6 * runtime_cpu,
    }
