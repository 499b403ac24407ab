"""Tensor-parallel MLP block (column Linear -> GELU -> row Linear, sequence parallel) on 2 gloo ranks:
forward+backward with and without the backward's communication/GEMM overlap, and the bytes a deferred W task
holds between B and W under each ``sp_wgrad_input`` option.

Run it inside the rate-limited loopback namespace (on plain loopback gloo is CPU work and nothing can hide):

    .venv/bin/python benchmarks/_netns.py --rate 1gbit -- .venv/bin/python benchmarks/bench_tp.py

hidden = (step without overlap - step with overlap) / (time of the overlappable collectives alone): the input
all-gather that runs under the column layer's dgrad GEMM and the dgrad reduce-scatter that runs under its
wgrad GEMM, each timed alone in the same process group.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import splitgrad
from _timing import interleaved_medians
from splitgrad.functional.tp_comm import all_gather_dim0, reduce_scatter_dim0
from splitgrad.testing import spawn


def _block(h: int, ffn: int, **kw) -> nn.Sequential:
    common = {"tp_group": dist.group.WORLD, "sequence_parallel": True, **kw}
    return nn.Sequential(
        splitgrad.Linear(h, ffn, parallel_mode="column", **common),
        nn.GELU(),
        splitgrad.Linear(ffn, h, parallel_mode="row", **common),
    )


def rank_main(rank: int, world: int, s: int, h: int, ffn: int, rounds: int) -> dict:
    torch.manual_seed(0)
    block = _block(h, ffn)
    x = torch.randn(s // world, 1, h, requires_grad=True)
    full = torch.randn(s, 1, h)

    def step(overlap: bool):
        def run() -> None:
            for m in block:
                if isinstance(m, splitgrad.Linear):
                    m.tp_comm_overlap = overlap
            block(x).sum().backward()

        return run

    cfg = block[0].tp
    variants = {
        "overlap": step(True),
        "no overlap": step(False),
        "collectives alone": lambda: (
            all_gather_dim0(x.detach(), cfg).wait(),
            reduce_scatter_dim0(full, cfg).wait(),
        ),
    }
    dist.barrier()
    medians = interleaved_medians(variants, rounds=rounds, warmup=2)
    held = {}
    for opt in ("keep", "regather"):
        b = _block(h, ffn, delay_wgrad_compute=True, sp_wgrad_input=opt)
        with splitgrad.capture_wgrad() as bundle:
            b(x).sum().backward()
        held[opt] = (bundle.saved_bytes(), [t.saved_bytes for t in bundle.tasks])
        bundle.run()
    return {"medians": medians, "held": held}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--ffn", type=int, default=4096)
    p.add_argument("--rounds", type=int, default=7)
    a = p.parse_args(argv)
    res = spawn(rank_main, 2, a.seq, a.hidden, a.ffn, a.rounds, timeout=1200, pg_timeout=600)
    print(f"TP MLP block, 2 ranks x 1 thread, s={a.seq} b=1 h={a.hidden} ffn={a.ffn} fp32, sequence parallel")
    print("| rank | overlap (ms) | no overlap (ms) | collectives alone (ms) | hidden |")
    print("|---|---:|---:|---:|---:|")
    for r, out in enumerate(res):
        m = {k: v * 1e3 for k, v in out["medians"].items()}
        hidden = (m["no overlap"] - m["overlap"]) / m["collectives alone"]
        print(
            f"| {r} | {m['overlap']:.1f} | {m['no overlap']:.1f} | {m['collectives alone']:.1f} | {hidden:.0%} |"
        )
    for opt, (total, per) in res[0]["held"].items():
        print(
            f"bytes held B->W, sp_wgrad_input={opt!r}: block {total / 2**20:.2f} MiB, per task {[f'{b / 2**20:.2f} MiB' for b in per]}"
        )


if __name__ == "__main__":
    main()
