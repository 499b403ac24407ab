"""V-Min and V-Half on the zero-bubble authors' configurations: peak activation memory and bubble.

Usage::

    python benchmarks/bench_v_schedules.py            # every configuration below
    python benchmarks/bench_v_schedules.py --auto     # and zbv-auto at V-Min's and V-Half's memory

Rows: ``p`` in {2, 3, 4, 5, 6, 8} x ``m`` in {8, 16, 24, 32} and the large ``(p, m)`` of the paper's tables, at
the costs the reference generator (sail-sg/zero-bubble-pipeline-parallelism, ``zbv_greedy.py``) uses when the
runtime builds these schedules (``F = B = W = 1000`` per V stage, comm 1); then the zero-bubble papers'
profiled costs: the ICLR Table 9 per-stage costs halved for a V stage (half the layers) and the arXiv ZB-V
per-stage costs. Peak in V-stage activations (the highest rank's; 1F1B holds ``2p``), bubble as
:attr:`~splitgrad.pipeline.SimulationResult.bubble_ratio`. docs/pipeline_schedules.md sets these figures next
to the reference generator's.
"""

from __future__ import annotations

import argparse
import time

from splitgrad.pipeline import build_schedule, simulate

REFERENCE_SHAPES = [(p, m) for p in (2, 3, 4, 5, 6, 8) for m in (8, 16, 24, 32)] + [
    (16, 48), (16, 64), (16, 128), (24, 72), (24, 96), (32, 96), (32, 128),
]  # fmt: skip
# (setting, p, m, f, b, w, comm) per V stage.
PAPER = [
    ("1.5B (ICLR / 2)", 8, 24, 18522 / 2, 18086 / 2, 9337 / 2, 601),
    ("1.5B (ICLR / 2)", 8, 32, 18513 / 2, 18086 / 2, 9331 / 2, 626),
    ("6.2B (ICLR / 2)", 8, 24, 29718 / 2, 29444 / 2, 19927 / 2, 527),
    ("6.2B (ICLR / 2)", 8, 32, 29802 / 2, 29428 / 2, 19530 / 2, 577),
    ("14.6B (ICLR / 2)", 16, 48, 11347 / 2, 11248 / 2, 8132 / 2, 377),
    ("14.6B (ICLR / 2)", 16, 64, 11307 / 2, 11254 / 2, 8101 / 2, 379),
    ("28.3B (ICLR / 2)", 32, 96, 10419 / 2, 10207 / 2, 7715 / 2, 408),
    ("28.3B (ICLR / 2)", 32, 128, 10408 / 2, 10204 / 2, 7703 / 2, 408),
    ("arXiv ZB-V", 16, 48, 14407, 14380, 9676, 1610),
    ("arXiv ZB-V", 16, 64, 14412, 14393, 9688, 1621),
    ("arXiv ZB-V", 16, 128, 14316, 14306, 9639, 1619),
    ("arXiv ZB-V", 24, 72, 6763, 6969, 5251, 755),
    ("arXiv ZB-V", 24, 96, 6783, 6984, 5259, 758),
    ("arXiv ZB-V", 32, 96, 9458, 9748, 7288, 879),
    ("arXiv ZB-V", 32, 128, 9469, 9744, 7306, 892),
]


def rows() -> list[tuple[str, int, int, float, float, float, float]]:
    return [("runtime default", p, m, 1000.0, 1000.0, 1000.0, 1.0) for p, m in REFERENCE_SHAPES] + PAPER


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--auto", action="store_true", help="also zbv-auto at V-Min's and V-Half's peak (slow)"
    )
    args = parser.parse_args()
    head = "| setting | p | m | F | B | W | comm | V-Min peak | V-Min bubble | V-Half peak | V-Half bubble |"
    rule = "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    if args.auto:
        head += " zbv-auto at V-Min's peak | zbv-auto at V-Half's peak |"
        rule += "---:|---:|"
    print(head + "\n" + rule)
    start = time.process_time()
    for setting, p, m, f, b, w, comm in rows():
        cells = []
        for name in ("v-min", "v-half"):
            result = simulate(build_schedule(name, 2 * p, m), f, b, w, comm)
            cells += [max(result.peak_activations), f"{result.bubble_ratio:.4f}"]
        if args.auto:
            for peak in (cells[0], cells[2]):
                plan = build_schedule("zbv-auto", 2 * p, m, f=f, b=b, w=w, comm=comm, memory_limit=peak)
                cells.append(f"{simulate(plan, f, b, w, comm).bubble_ratio:.4f}")
        print(
            f"| {setting} | {p} | {m} | {f:g} | {b:g} | {w:g} | {comm:g} | "
            + " | ".join(map(str, cells))
            + " |"
        )
    print(f"\n{time.process_time() - start:.1f} s CPU")


if __name__ == "__main__":
    main()
