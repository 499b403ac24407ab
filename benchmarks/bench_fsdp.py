"""FSDP2 step with deferred wgrad (``defer_fsdp_reduction``) vs FSDP2 immediate vs torch DDP, 2 gloo ranks.

Run inside the rate-limited loopback namespace (overlap cannot be measured on plain loopback, see
``benchmarks/_netns.py``)::

    python benchmarks/_netns.py --rate 4gbit -- .venv/bin/python benchmarks/bench_fsdp.py --samples 8

Each variant's step is forward + backward (+ ``backward_dw``), max wall time over ranks. ``compute`` is the
same model unwrapped (no communication); ``comm alone`` is FSDP2's communication for one step timed by itself
(all-gather of every layer's parameters + reduce-scatter of every gradient); exposed = step - compute;
hidden = 1 - exposed / comm alone.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

import splitgrad
from splitgrad.parallel import defer_fsdp_reduction
from splitgrad.testing import spawn


def build(width: int, layers: int, delay: bool) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[splitgrad.Linear(width, width, delay_wgrad_compute=delay) for _ in range(layers)])


def shard(model: nn.Sequential) -> nn.Sequential:
    for layer in model:
        fully_shard(layer, reshard_after_forward=False)
    fully_shard(model, reshard_after_forward=False)
    return model


def _timed(fn: Callable[[], None]) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    t = torch.tensor([time.perf_counter() - start])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _rank(rank: int, world: int, cfg: dict) -> dict[str, float] | None:
    width, layers = cfg["width"], cfg["layers"]
    x = torch.randn(cfg["tokens"], width, generator=torch.Generator().manual_seed(rank))
    plain = build(width, layers, False)
    ddp = nn.parallel.DistributedDataParallel(build(width, layers, False))
    immediate = shard(build(width, layers, False))
    delayed = shard(build(width, layers, True))
    defer_fsdp_reduction(delayed)
    flat = torch.zeros(layers * width * width)
    shard_out = torch.empty(flat.numel() // world)

    def step(model: nn.Module, split: bool) -> Callable[[], None]:
        def run() -> None:
            model.zero_grad()
            model(x).square().mean().backward()
            if split:
                splitgrad.backward_dw(model)

        return run

    def comm_alone() -> None:
        dist.all_gather_into_tensor(flat, shard_out)
        dist.reduce_scatter_tensor(shard_out, flat)

    variants = {
        "compute (no comm)": step(plain, False),
        "comm alone": comm_alone,
        "torch DDP": step(ddp, False),
        "FSDP2 immediate": step(immediate, False),
        "FSDP2 delayed + defer_fsdp_reduction": step(delayed, True),
    }
    samples: dict[str, list[float]] = {k: [] for k in variants}
    names = list(variants)
    for i in range(cfg["warmup"] + cfg["samples"]):
        for name in names[i % len(names) :] + names[: i % len(names)]:
            t = _timed(variants[name])
            if i >= cfg["warmup"]:
                samples[name].append(t)
    return {k: statistics.median(v) for k, v in samples.items()} if rank == 0 else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=512, help="tokens per rank per step")
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    med = spawn(_rank, 2, vars(args), timeout=3600, threads=1)[0]
    compute, comm = med["compute (no comm)"], med["comm alone"]
    print(
        f"2 gloo ranks x 1 thread, {args.layers} x Linear({args.width}, {args.width}) fp32, {args.tokens} tokens/rank, "
        f"reshard_after_forward=False, {args.samples} samples; medians (ms)\n"
    )
    print("| variant | step (ms) | ratio vs torch DDP | exposed comm (ms) | comm hidden |")
    print("|---|---:|---:|---:|---:|")
    for name, t in med.items():
        if name in ("compute (no comm)", "comm alone"):
            print(f"| {name} | {1e3 * t:.1f} | | | |")
            continue
        exposed = t - compute
        hidden = "" if name == "torch DDP" else f"{100 * max(0.0, 1 - exposed / comm):.0f} %"
        print(f"| {name} | {1e3 * t:.1f} | {t / med['torch DDP']:.3f} | {1e3 * exposed:.1f} | {hidden} |")


if __name__ == "__main__":
    main()
