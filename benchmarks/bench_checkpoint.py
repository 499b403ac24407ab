"""What surviving costs per training step: a checkpoint (synchronous vs asynchronous) and a safe optimizer step.

Run: ``.venv/bin/python benchmarks/bench_checkpoint.py [--quick]`` (defaults: a 2-rank ZB-H1 pipeline of 2
MLP blocks, H=256, FFN 4H, 4 microbatches of 8 rows, AdamW; ``--quick``: H=32, 3 rounds).

One 2-rank spawn times a full training step (zero_grad, the schedule, the optimizer) followed by:

* ``step``: ``optimizer.step()`` alone (the baseline);
* ``+ sync save``: :meth:`PipelineCheckpointer.save` with ``async_save=False`` (the step waits for the files);
* ``+ async save``: ``async_save=True``: the step waits only for the copy to CPU memory, the files are
  written by a background thread, and the next save (one step later) first waits for the previous one;
* ``SafeStep sync``: :class:`~splitgrad.pipeline.safe_step.SafeStep` (global norm, clip at a norm never
  reached, NaN/inf skip) instead of ``optimizer.step()``: the step waits for the all-reduce, then steps;
* ``SafeStep post-validate``: the same with ``post_validate=True``: steps speculatively while the all-reduce
  is in flight (a snapshot of the parameters and AdamW state per step; the check always passes);
* ``SafeStep post-validate, rollback``: ``max_norm`` below every norm: each step is rolled back and redone
  clipped (the worst case).

The three checkpoint variants run in blocks of consecutive steps (twice each, the writes drained between
blocks), since an asynchronous write overlaps the steps after it; the safe-step variants run round-robin
(``benchmarks/_timing.py``). Rank 0 prints the medians of its wall clock. On a shared CPU machine these are rough: the async writes
compete with the steps for the same cores, and the all-reduce that post-validation hides is a few bytes over
loopback gloo; on GPUs with a real network the balance differs.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

import splitgrad
from _timing import interleaved_medians, print_table
from splitgrad.pipeline import build_runtime
from splitgrad.pipeline.checkpoint import PipelineCheckpointer
from splitgrad.pipeline.safe_step import SafeStep
from splitgrad.testing import spawn


def _blocks(hidden: int, n: int) -> list[torch.nn.Module]:
    torch.manual_seed(0)
    return [
        torch.nn.Sequential(
            splitgrad.Linear(hidden, 4 * hidden, delay_wgrad_compute=True),
            torch.nn.GELU(),
            splitgrad.Linear(4 * hidden, hidden, delay_wgrad_compute=True),
        )
        for _ in range(n)
    ]


def run_rank(rank: int, world: int, hidden: int, rounds: int, root: str) -> dict[str, float]:
    """Time every variant on this rank; returns median seconds per variant."""
    torch.set_num_threads(1)
    stages = _blocks(hidden, 2)
    rt = build_runtime(stages, "zb-h1", n_microbatches=4, loss_fn=F.mse_loss, record_timeline=False)
    opt = torch.optim.AdamW(rt.parameters(), lr=1e-4)
    ckpt = PipelineCheckpointer(root, rt, torch.nn.Sequential(*stages), opt)
    x, y = torch.randn(32, hidden), torch.randn(32, hidden)
    safe = {
        "sync": SafeStep(opt, max_norm=1e9),
        "post": SafeStep(opt, max_norm=1e9, post_validate=True),
        "rollback": SafeStep(opt, max_norm=1e-9, post_validate=True),
    }
    saves = {"n": 0}

    def train(then) -> None:
        rt.zero_grad()
        rt.step(x, y)
        then()

    def save(asynchronous: bool) -> None:
        saves["n"] += 1
        ckpt.save(saves["n"], async_save=asynchronous)

    # Checkpoints in blocks of consecutive steps (none, sync, async; twice), drained between blocks: an async
    # write runs on while the following steps run, so interleaving it with other variants would bill them.
    per_step: dict[str, list[float]] = {"step": [], "+ sync save": [], "+ async save": []}
    for _ in range(2):
        for name, then in {
            "step": opt.step,
            "+ sync save": lambda: (opt.step(), save(False)),
            "+ async save": lambda: (opt.step(), save(True)),
        }.items():
            for _ in range(rounds):
                start = time.perf_counter()
                train(then)
                per_step[name].append(time.perf_counter() - start)
            ckpt.wait()
    medians = {name: statistics.median(samples) for name, samples in per_step.items()}
    safe_variants = {
        "step": lambda: train(opt.step),
        "SafeStep sync": lambda: train(safe["sync"].step),
        "SafeStep post-validate": lambda: train(safe["post"].step),
        "SafeStep post-validate, rollback": lambda: train(safe["rollback"].step),
    }
    medians |= {
        k if k != "step" else "step (interleaved)": v
        for k, v in interleaved_medians(safe_variants, rounds=rounds, warmup=1).items()
    }
    ckpt.close()
    rt.close()
    dist.barrier()
    return medians


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny smoke configuration (seconds)")
    parser.add_argument("--hidden", type=int, default=256, help="hidden size of the MLP blocks")
    parser.add_argument("--rounds", type=int, default=15, help="timed rounds per variant")
    args = parser.parse_args()
    hidden, rounds = (32, 3) if args.quick else (args.hidden, args.rounds)
    with tempfile.TemporaryDirectory() as root:
        results = spawn(run_rank, 2, hidden, rounds, str(Path(root)), timeout=1800, pg_timeout=600)
    params = sum(p.numel() for block in _blocks(hidden, 2) for p in block.parameters())
    print(f"2-rank zb-h1, 2 MLP stages of H={hidden} ({params:,} parameters, AdamW), {rounds} rounds")
    medians = results[0]
    print_table(
        "step + checkpoint every step (rank 0, wall clock, blocks of consecutive steps)",
        {k: medians[k] for k in ("step", "+ sync save", "+ async save")},
        "step",
    )
    print_table(
        "step + safe optimizer step (rank 0, wall clock, round-robin)",
        {k: v for k, v in medians.items() if k.startswith(("step (", "SafeStep"))},
        "step (interleaved)",
    )


if __name__ == "__main__":
    main()
