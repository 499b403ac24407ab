"""Tensor-parallel MLP block (column Linear -> GELU -> row Linear, sequence parallel) on 2 gloo ranks:
forward+backward with and without the backward's communication/GEMM overlap, the hidden fraction per rank and
over ranks, and the bytes a deferred W task holds between B and W under each ``sp_wgrad_input`` option.

Run it inside the rate-limited loopback namespace (on plain loopback gloo is CPU work and nothing can hide):

    .venv/bin/python benchmarks/_netns.py --rate 1gbit -- .venv/bin/python benchmarks/bench_tp.py
    .venv/bin/python benchmarks/_netns.py --rate 1gbit -- .venv/bin/python benchmarks/bench_tp.py --seq 64 \
        --hidden 64 --ffn 256 --rounds 3          # tiny: proves it runs

The overlappable collectives are the asynchronous ones of the column layer's backward: the all-gather of its
input (under the dgrad GEMM) and the reduce-scatter of its input gradient (under the wgrad GEMM). Every wait
on them is timed in-process, so two figures come out:

* ``hidden (waits)`` = 1 - (time blocked in those waits with overlap) / (the same without overlap). Without
  overlap each wait lasts the whole collective; with it only what the GEMM did not cover. Load on the cores
  slows the GEMMs, which only hides more, so this is the figure to trust on a shared machine.
* ``hidden (step)`` = (step without overlap - step with overlap) / (the two collectives timed alone), the
  end-to-end saving; on a loaded machine the ranks drift apart and this one can exceed 100 %.

"max" rows take the slowest rank (a step is as slow as its slowest rank). One traced step per variant prints
the event order of rank 0's column backward (collective started, wait began, wait ended, relative to the
backward's start): with overlap the wait must begin after the GEMM ran, i.e. later than the next start.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import splitgrad
from _timing import interleaved_medians
from splitgrad.distributed import tp_comm
from splitgrad.distributed.tp_comm import all_gather_dim0, reduce_scatter_dim0
from splitgrad.testing import spawn


class WaitRecorder:
    """Times every asynchronous TP collective: started, wait began, wait ended (perf_counter), bytes sent.

    Bytes are what one rank sends in a ring over ``world`` ranks: an all-gather its ``1/world`` share to
    ``world - 1`` peers, a reduce-scatter ``world - 1`` blocks of its result's size, an all-reduce twice
    ``(world - 1) / world`` of the tensor.
    """

    def __init__(self) -> None:
        self.events: list[tuple[str, str, float, int]] = []  # (kind, what, time, bytes)
        self.blocked_s = 0.0
        self.waits = 0
        self.bytes = 0

    @contextlib.contextmanager
    def installed(self) -> Iterator[WaitRecorder]:
        """Wrap ``PendingCollective`` for the duration (a benchmark-only patch, restored on exit)."""
        cls = tp_comm.PendingCollective
        init, wait = cls.__init__, cls.wait
        started: dict[int, str] = {}
        rec = self

        def traced_init(pc, result, work, what, cfg):  # the original signature
            init(pc, result, work, what, cfg)
            if work is not None:  # asynchronous: the overlappable ones
                world = dist.get_world_size()
                size = result.numel() * result.element_size()
                if what.startswith("all-gather"):
                    size = size * (world - 1) // world
                elif what.startswith("reduce-scatter"):
                    size = size * (world - 1)
                else:
                    size = 2 * size * (world - 1) // world
                started[id(pc)] = what
                rec.events.append(("start", what, time.perf_counter(), size))
                rec.bytes += size

        def traced_wait(pc):
            what = started.pop(id(pc), None)
            if what is None:
                return wait(pc)
            t0 = time.perf_counter()
            out = wait(pc)
            t1 = time.perf_counter()
            rec.events += [("wait", what, t0, 0), ("done", what, t1, 0)]
            rec.blocked_s += t1 - t0
            rec.waits += 1
            return out

        cls.__init__, cls.wait = traced_init, traced_wait
        try:
            yield self
        finally:
            cls.__init__, cls.wait = init, wait


def _block(h: int, ffn: int, **kw) -> nn.Sequential:
    common = {"tp_group": dist.group.WORLD, "sequence_parallel": True, **kw}
    return nn.Sequential(
        splitgrad.Linear(h, ffn, parallel_mode="column", **common),
        nn.GELU(),
        splitgrad.Linear(ffn, h, parallel_mode="row", **common),
    )


def rank_main(rank: int, world: int, s: int, h: int, ffn: int, rounds: int) -> dict:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    block = _block(h, ffn)
    x = torch.randn(s // world, 1, h, requires_grad=True)
    full = torch.randn(s, 1, h)
    recorders = {True: WaitRecorder(), False: WaitRecorder()}
    cpu = {True: 0.0, False: 0.0}

    def step(overlap: bool):
        def run() -> None:
            for m in block:
                if isinstance(m, splitgrad.Linear):
                    m.tp_comm_overlap = overlap
            c0 = time.process_time()
            with recorders[overlap].installed():
                block(x).sum().backward()
            cpu[overlap] += time.process_time() - c0

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
    warmup = 2
    medians = interleaved_medians(variants, rounds=rounds, warmup=warmup)
    steps = rounds + warmup
    # One traced step per variant, after the timed ones: the event order of the column backward.
    traces = {}
    for overlap in (True, False):
        rec = WaitRecorder()
        for m in block:
            if isinstance(m, splitgrad.Linear):
                m.tp_comm_overlap = overlap
        y = block(x).sum()
        dist.barrier()
        t0 = time.perf_counter()
        with rec.installed():
            y.backward()
        traces[overlap] = [(kind, what, (t - t0) * 1e3) for kind, what, t, _ in rec.events]
    held = {}
    for opt in ("keep", "regather"):
        b = _block(h, ffn, delay_wgrad_compute=True, sp_wgrad_input=opt)
        with splitgrad.capture_wgrad() as bundle:
            b(x).sum().backward()
        held[opt] = (bundle.saved_bytes(), [t.saved_bytes for t in bundle.tasks])
        bundle.run()
    per_step = {
        ov: {
            "blocked_ms": r.blocked_s / steps * 1e3,
            "waits": r.waits / steps,
            "mib": r.bytes / steps / 2**20,
            "cpu_ms": cpu[ov] / steps * 1e3,
        }
        for ov, r in recorders.items()
    }
    return {"medians": medians, "per_step": per_step, "traces": traces, "held": held}


def _row(label: str, m: dict[str, float], ov: dict, no: dict) -> str:
    waits_hidden = 1 - ov["blocked_ms"] / no["blocked_ms"] if no["blocked_ms"] > 0 else float("nan")
    step_hidden = (m["no overlap"] - m["overlap"]) / m["collectives alone"]
    return (
        f"| {label} | {m['overlap']:.1f} | {m['no overlap']:.1f} | {m['collectives alone']:.1f} | "
        f"{ov['blocked_ms']:.1f} | {no['blocked_ms']:.1f} | {waits_hidden:.0%} | {step_hidden:.0%} | "
        f"{ov['cpu_ms']:.1f} / {no['cpu_ms']:.1f} |"
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--ffn", type=int, default=4096)
    p.add_argument("--rounds", type=int, default=7)
    a = p.parse_args(argv)
    res = spawn(rank_main, 2, a.seq, a.hidden, a.ffn, a.rounds, timeout=1200, pg_timeout=600)
    print(f"TP MLP block, 2 ranks x 1 thread, s={a.seq} b=1 h={a.hidden} ffn={a.ffn} fp32, sequence parallel")
    ps = res[0]["per_step"][True]
    print(
        f"overlappable collectives per step and rank: {ps['waits']:.0f} waits, {ps['mib']:.2f} MiB sent "
        "(input all-gather + dgrad reduce-scatter of the column layer)"
    )
    print(
        "| rank | step overlap (ms) | step no overlap (ms) | collectives alone (ms) | blocked overlap (ms) | "
        "blocked no overlap (ms) | hidden (waits) | hidden (step) | CPU ms overlap / no |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    rows = []
    for r, out in enumerate(res):
        m = {k: v * 1e3 for k, v in out["medians"].items()}
        rows.append((m, out["per_step"][True], out["per_step"][False]))
        print(_row(str(r), *rows[-1]))
    worst = (
        {k: max(row[0][k] for row in rows) for k in rows[0][0]},
        *({k: max(row[i][k] for row in rows) for k in rows[0][i]} for i in (1, 2)),
    )
    print(_row("max", *worst))
    for overlap, trace in res[0]["traces"].items():
        events = ", ".join(f"{kind} {what.split(' of ')[0]} {t:.2f}" for kind, what, t in trace)
        print(f"rank 0 column backward, overlap={overlap} (ms from backward start): {events}")
    for opt, (total, per) in res[0]["held"].items():
        per_mib = [f"{b / 2**20:.2f} MiB" for b in per]
        print(f"bytes held B->W, sp_wgrad_input={opt!r}: block {total / 2**20:.2f} MiB, per task {per_mib}")


if __name__ == "__main__":
    main()
