"""Shared benchmark timing: interleaved rounds, medians and ratios (the machines are shared and noisy).

Variants are timed round-robin (A, B, C, A, B, C, ...) rather than in blocks, so slow drift of the machine
(another process starting, thermal changes) hits every variant alike; the ratio of medians is reported.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.process_time}
"""``cpu`` (process CPU time) is far steadier than wall time on a shared, oversubscribed machine, where being
descheduled would otherwise land on whichever variant happened to run; use it with one thread (with several
it also counts spinning workers)."""


def interleaved_medians(
    variants: dict[str, Callable[[], None]], *, rounds: int, warmup: int = 1, clock: str = "wall"
) -> dict[str, float]:
    """Run each variant ``warmup`` times, then ``rounds`` times round-robin; return median seconds per variant.

    Args:
        clock: a key of :data:`CLOCKS`.
    """
    now = CLOCKS[clock]
    for fn in variants.values():
        for _ in range(warmup):
            fn()
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            start = now()
            fn()
            samples[name].append(now() - start)
    return {name: statistics.median(s) for name, s in samples.items()}


def print_table(
    title: str, medians: dict[str, float], baseline: str, extra: dict[str, str] | None = None
) -> None:
    """Print ``name | median ms | ratio vs baseline`` as a Markdown table (pasteable into the README)."""
    base = medians[baseline]
    print(f"\n{title}\n")
    print("| variant | median (ms) | ratio vs " + baseline + " |" + (" note |" if extra else ""))
    print("|---|---:|---:|" + ("---|" if extra else ""))
    for name, t in medians.items():
        note = f" {extra.get(name, '')} |" if extra else ""
        print(f"| {name} | {t * 1e3:.1f} | {t / base:.3f} |{note}")
