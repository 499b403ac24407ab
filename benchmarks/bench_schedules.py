"""Schedule generation, validation and simulation time at scale (default p = 64 ranks, m = 512 microbatches).

Usage::

    python benchmarks/bench_schedules.py                 # p=64, m=512, 5 repeats
    python benchmarks/bench_schedules.py --ranks 16 --microbatches 64 --auto

Prints one row per schedule family: median wall time of build, simulate and validate over the repeats, the
build+simulate total the issue asks to keep well under a second (wall median, and the minimum CPU time of the
process, which is what to compare on a shared, loaded machine), the cost per action, and the simulated
unit-cost bubble ratio and peak activations. ``--auto`` adds zb-auto (a greedy search: many simulations).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

from splitgrad.pipeline import build_schedule, simulate, validate


def _time(fn: Callable[[], Any], repeats: int) -> tuple[float, float, Any]:
    """(median wall seconds, minimum CPU seconds, last result) over ``repeats`` calls."""
    walls, cpus, out = [], [], None
    for _ in range(repeats):
        w0, c0 = time.perf_counter(), time.process_time()
        out = fn()
        cpus.append(time.process_time() - c0)
        walls.append(time.perf_counter() - w0)
    return statistics.median(walls), min(cpus), out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=64)
    parser.add_argument("--microbatches", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--auto", action="store_true", help="also time zb-auto (slow: a search)")
    args = parser.parse_args()
    p, m = args.ranks, args.microbatches

    cases: list[tuple[str, int, dict[str, Any]]] = [
        ("gpipe", p, {}),
        ("1f1b", p, {}),
        ("interleaved-1f1b", 2 * p, {}),
        ("zb-h1", p, {}),
        ("zb-h2", p, {}),
        ("zbv", 2 * p, {}),
        ("v-half", 2 * p, {}),
        ("v-min", 2 * p, {}),
        ("dualpipev", 2 * p, {}),
    ]
    if args.auto:
        cases.append(("zb-auto", p, {"f": 1.0, "b": 1.2, "w": 0.8}))

    print(
        f"p = {p} ranks, m = {m} microbatches; wall = median of {args.repeats}, cpu = min of {args.repeats} (s)"
    )
    header = (
        f"{'schedule':<17} {'stages':>6} {'actions':>8} {'build':>7} {'simulate':>9} {'validate':>9} "
        f"{'build+sim':>9} {'cpu b+s':>8} {'us/action':>9} {'bubble':>7} {'peak':>5}"
    )
    print(header)
    print("-" * len(header))
    for name, n_stages, options in cases:
        repeats = 1 if name == "zb-auto" else args.repeats
        t_build, c_build, schedule = _time(lambda: build_schedule(name, n_stages, m, **options), repeats)  # noqa: B023
        t_sim, c_sim, result = _time(lambda: simulate(schedule), repeats)  # noqa: B023
        t_val, _, _ = _time(lambda: validate(schedule), repeats)  # noqa: B023
        cpu = c_build + c_sim
        print(
            f"{name:<17} {n_stages:>6} {schedule.n_actions:>8} {t_build:>7.3f} {t_sim:>9.3f} {t_val:>9.3f} "
            f"{t_build + t_sim:>9.3f} {cpu:>8.3f} {1e6 * cpu / schedule.n_actions:>9.2f} "
            f"{result.bubble_ratio:>7.4f} {max(result.peak_activations):>5}"
        )


if __name__ == "__main__":
    main()
