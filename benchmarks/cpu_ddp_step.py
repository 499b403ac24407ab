"""CPU time per step of the DDP variants in one process (world of 1), paired and interleaved.

Load on a shared machine distorts wall time; the CPU time a step costs its process (``time.process_time``,
one compute thread) is what the wrapper's bookkeeping adds, and it is comparable between variants measured in
the same rounds. Each round runs every variant once (rotated order); the figure is the median over rounds.

    python benchmarks/cpu_ddp_step.py --rounds 20             # 8 x Linear(1024, 1024), 256 tokens
    python benchmarks/cpu_ddp_step.py --rounds 3 --width 64   # smoke test

Variants: ``nn.Linear`` (plain torch model, zero_grad + forward + backward), ``splitgrad.Linear`` (same, no
DDP), ``torch DDP`` (inside ``no_sync``), ``splitgrad DDP immediate`` / ``immediate+fused`` (inside
``no_sync``, ``zero_grad_buffer`` included) — the ``compute`` column of ``bench_ddp.py`` — and both again
with ``lazy_zero=False`` (every buffer zeroed at once at ``zero_grad_buffer``; the default, ``lazy_zero=True``,
writes each slice over with its first gradient instead).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

import splitgrad
from splitgrad.parallel import DistributedDataParallel


def _model(width: int, layers: int, *, split: bool, fused: bool = False) -> nn.Module:
    torch.manual_seed(0)
    mods: list[nn.Module] = []
    for _ in range(layers):
        lin = (
            splitgrad.Linear(width, width, fuse_wgrad_accumulation=fused)
            if split
            else nn.Linear(width, width)
        )
        mods += [lin, nn.Tanh()]
    return nn.Sequential(*mods)


def variants(width: int, layers: int, tokens: int) -> dict[str, Callable[[], None]]:
    """name -> one step (zero, forward, backward) of each variant."""
    x = torch.randn(tokens, width)
    plain, split = _model(width, layers, split=False), _model(width, layers, split=True)
    theirs = nn.parallel.DistributedDataParallel(_model(width, layers, split=True))
    ours = DistributedDataParallel(_model(width, layers, split=True))  # lazy_zero=True (default)
    fused = DistributedDataParallel(_model(width, layers, split=True, fused=True))
    # lazy_zero=False: every buffer zeroed at once (the paired "before" of the default lazy zeroing).
    eager = DistributedDataParallel(_model(width, layers, split=True), lazy_zero=False)
    eager_fused = DistributedDataParallel(_model(width, layers, split=True, fused=True), lazy_zero=False)

    def bare(model: nn.Module) -> Callable[[], None]:
        def step() -> None:
            model.zero_grad(set_to_none=True)
            model(x).sum().backward()

        return step

    def torch_ddp() -> None:
        theirs.zero_grad(set_to_none=True)
        with theirs.no_sync():
            theirs(x).sum().backward()

    def splitgrad_ddp(ddp: DistributedDataParallel) -> Callable[[], None]:
        def step() -> None:
            ddp.zero_grad_buffer()
            with ddp.no_sync():
                ddp(x).sum().backward()

        return step

    return {
        "nn.Linear": bare(plain),
        "splitgrad.Linear": bare(split),
        "torch DDP": torch_ddp,
        "splitgrad DDP immediate": splitgrad_ddp(ours),
        "immediate+fused": splitgrad_ddp(fused),
        "immediate, lazy_zero=False": splitgrad_ddp(eager),
        "fused, lazy_zero=False": splitgrad_ddp(eager_fused),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=256)
    args = parser.parse_args()
    torch.set_num_threads(1)  # CPU time of one compute thread: comparable between variants
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group(
            "gloo", init_method=f"file://{os.path.join(tmp, 'store')}", rank=0, world_size=1
        )
        try:
            steps = variants(args.width, args.layers, args.tokens)
            names = list(steps)
            for step in steps.values():  # warm-up: allocator, first-call paths
                step()
                step()
            cpu: dict[str, list[float]] = {n: [] for n in names}
            for r in range(args.rounds):
                for name in names[r % len(names) :] + names[: r % len(names)]:
                    start = time.process_time()
                    steps[name]()
                    cpu[name].append(time.process_time() - start)
            base = statistics.median(cpu["torch DDP"])
            print(
                f"CPU ms per step, median of {args.rounds} rounds ({args.layers} x Linear({args.width}), "
                f"{args.tokens} tokens, 1 thread)"
            )
            for name in names:
                med = statistics.median(cpu[name])
                print(
                    f"  {name:28s} {med * 1e3:8.2f} ms   vs torch DDP {(med - base) * 1e3:+.2f} ms ({med / base:.3f})"
                )
        finally:
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
