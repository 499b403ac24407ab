"""Shared benchmark timing: interleaved rounds, medians and ratios (the machines are shared and noisy).

Variants are timed round-robin (A, B, C, A, B, C, ...) rather than in blocks, so slow drift of the machine
(another process starting, thermal changes) hits every variant alike; the ratio of medians is reported.
:func:`interleaved_samples` keeps every sample instead, alternating the order each round, for ratios paired
by round (:func:`paired_ratio`) and the page faults each call caused.
"""

from __future__ import annotations

import resource
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.process_time}
"""``cpu`` (process CPU time) is far steadier than wall time on a shared, oversubscribed machine, where being
descheduled would otherwise land on whichever variant happened to run; use it with one thread (with several
it also counts spinning workers)."""


def interleaved_medians(
    variants: dict[str, Callable[[], None]], *, rounds: int, warmup: int = 1, clock: str = "wall"
) -> dict[str, float]:
    """Run each variant ``warmup`` times, then ``rounds`` times round-robin (always in the given order); return
    median seconds per variant.

    Args:
        clock: a key of :data:`CLOCKS`.
    """
    samples = interleaved_samples(variants, rounds=rounds, warmup=warmup, clock=clock, alternate=False)
    return {name: s.median for name, s in samples.items()}


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


def quartiles(values: list[float]) -> tuple[float, float]:
    """(first, third) quartile; both the one value when there is only one."""
    if len(values) < 2:
        return values[0], values[0]
    q = statistics.quantiles(values, n=4)
    return q[0], q[2]


@dataclass
class Samples:
    """One variant's calls: seconds and minor page faults (pages the kernel had to map and zero) per call."""

    seconds: list[float] = field(default_factory=list)
    faults: list[int] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)


def interleaved_samples(
    variants: dict[str, Callable[[], None]],
    *,
    rounds: int,
    warmup: int = 1,
    clock: str = "cpu",
    alternate: bool = True,
) -> dict[str, Samples]:
    """Run each variant ``warmup`` times, then ``rounds`` rounds of one call each, in the given order; with
    ``alternate``, in reverse order on odd rounds (so no variant always follows the same neighbour).

    Page faults come from ``getrusage``: the process's minor faults around each call. A fresh allocation the
    allocator takes from the kernel (glibc ``mmap``s every block of 32 MiB or more, and may trim its heap
    after a free) faults once per 4 KiB page on first touch; that cost lands in the process's system time.
    """
    now = CLOCKS[clock]
    for fn in variants.values():
        for _ in range(warmup):
            fn()
    names = list(variants)
    samples = {name: Samples() for name in names}
    for r in range(rounds):
        for name in names[::-1] if alternate and r % 2 else names:
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            start = now()
            variants[name]()
            samples[name].seconds.append(now() - start)
            samples[name].faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults)
    return samples


def paired_ratio(samples: Samples, baseline: Samples) -> tuple[float, tuple[float, float]]:
    """Median and quartiles of ``samples / baseline`` paired by round (both ran back to back each round)."""
    ratios = [s / b for s, b in zip(samples.seconds, baseline.seconds, strict=True)]
    return statistics.median(ratios), quartiles(ratios)


def print_paired_table(title: str, samples: dict[str, Samples], baseline: str) -> None:
    """Print ``variant | median ms | ratio (paired median) | quartiles | page faults per call`` as Markdown."""
    base = samples[baseline]
    print(f"\n{title}\n")
    print(f"| variant | median (ms) | ratio vs {baseline} (paired) | quartiles | page faults / call |")
    print("|---|---:|---:|---:|---:|")
    for name, s in samples.items():
        ratio, (q1, q3) = paired_ratio(s, base)
        print(
            f"| {name} | {s.median * 1e3:.1f} | {ratio:.3f} | [{q1:.3f}, {q3:.3f}] | "
            f"{statistics.median(s.faults):.0f} |"
        )
