"""splitgrad ``zbv`` (and V-Half, V-Min) head to head with PyTorch's zero-bubble schedules on 2 CPU ranks,
paired by round.

Run: ``.venv/bin/python benchmarks/bench_pipeline_head_to_head.py [--quick] [--rounds 16]`` (also
``bench_pipeline.py --head-to-head``). The model, data and variants are ``bench_pipeline.py``'s
(``_pipeline_variants.py``); only splitgrad's V schedules (``zbv``, ``v-half``, ``v-min``: at 2 ranks all
three hold 4 half-stage activations) and PyTorch's zero-bubble variants of each activation rank are built and
timed (16 rounds by default, no memory spawn, about 6 minutes on 2 idle cores): fewer variants per
round make many more rounds affordable, which the throughput target needs on a noisy machine. Per PyTorch
variant it prints splitgrad's throughput over it paired by round (median, quartiles, and in how many rounds
splitgrad was faster), then the realisation table of ``bench_pipeline.py``.
"""

from __future__ import annotations

import argparse
import os
import statistics
from dataclasses import asdict

from _pipeline_report import cells, print_realisation, summarize
from _pipeline_rounds import run_rank
from _pipeline_variants import BenchConfig
from _timing import quartiles
from splitgrad.testing import spawn

QUICK = dict(hidden=64, ffn=256, tokens=128, seq=32, rounds=2)
"""The smoke configuration (``--quick``) of both pipeline benchmarks."""


def print_head_to_head(cfg: BenchConfig, rows: dict[str, dict]) -> None:
    """splitgrad ``zbv`` against every PyTorch zero-bubble variant of the same activations, paired by round."""
    print(
        f"\nHead to head, 2 gloo ranks x 1 thread: {asdict(cfg)}; load average now {os.getloadavg()[0]:.1f}\n"
    )
    print(
        "| act. | variant | median step (s) | measured bubble | splitgrad zbv throughput / this (paired median) "
        "| (quartiles) | rounds splitgrad faster |"
    )
    print("|---|---|---:|---:|---:|---:|---:|")
    for tag in ("2-D", "3-D"):
        row = {k.split("|")[1]: v for k, v in rows.items() if k.startswith(tag)}
        ours = row["splitgrad zbv"]["steps"]
        for name, r in row.items():
            ratios = [t / o for t, o in zip(r["steps"], ours)]
            paired = "-", "-", "-"
            if name != "splitgrad zbv":
                q1, q3 = quartiles(ratios)
                faster = sum(x > 1 for x in ratios)
                paired = (
                    f"{statistics.median(ratios):.3f}",
                    f"[{q1:.3f}, {q3:.3f}]",
                    f"{faster} / {len(ratios)}",
                )
            print(
                f"| {tag} | {name} | {r['step']:.3f} | {cells([r['bubble']], '.3f')} | {paired[0]} | {paired[1]} "
                f"| {paired[2]} |"
            )
    print_realisation(rows)


def run(*, quick: bool = False, rounds: int | None = None, timeout: float = 900.0) -> None:
    """Time the head-to-head variants in one 2-rank spawn and print both tables.

    Args:
        quick: tiny sizes (a smoke run).
        rounds: timed rounds (default 16; 2 with ``quick``).
        timeout: seconds the spawn may take.
    """
    cfg = BenchConfig(**(QUICK if quick else {"rounds": 16}))
    if rounds is not None:
        cfg.rounds = rounds
    timing = spawn(run_rank, 2, asdict(cfg), False, True, timeout=timeout, pg_timeout=600)
    print_head_to_head(cfg, summarize(cfg, timing, []))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny smoke configuration (seconds of compute)")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds (default 16)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds for the 2-rank spawn")
    args = parser.parse_args()
    run(quick=args.quick, rounds=args.rounds, timeout=args.timeout)


if __name__ == "__main__":
    main()
