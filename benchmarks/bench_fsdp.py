"""FSDP2 step with deferred wgrad (``defer_fsdp_reduction``, in-task and background reduce-scatter) vs FSDP2
immediate vs torch DDP, on 2 gloo ranks.

Run inside the rate-limited loopback namespace (overlap cannot be measured on plain loopback, see
``benchmarks/_netns.py``)::

    python benchmarks/_netns.py --rate 4gbit -- .venv/bin/python benchmarks/bench_fsdp.py --samples 8

Each variant's step is forward + backward (+ ``backward_dw``, + ``handle.finish()``), max wall time over ranks.
``compute`` is the same model unwrapped (no communication); ``comm alone`` is FSDP2's communication for one
step timed by itself (all-gather of every layer's parameters + reduce-scatter of every gradient), ``RS alone``
only the reduce-scatter; exposed = step - compute; hidden = 1 - exposed / comm alone.

Load-independent evidence for the background mode (``mode="async"``), from rank 0's own clock in one process:
``RS under W`` is the share of the background reduce-scatters' time that ran while ``backward_dw`` was still
computing (before the first blocking wait, ``finish()``), and how many were still running when ``backward_dw``
returned; CPU is the rank's process CPU time per step (``time.process_time``).
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

ASYNC = "FSDP2 delayed, background RS (mode='async')"


def build(width: int, layers: int, delay: bool) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[splitgrad.Linear(width, width, delay_wgrad_compute=delay) for _ in range(layers)])


def shard(model: nn.Sequential) -> nn.Sequential:
    for layer in model:
        fully_shard(layer, reshard_after_forward=False)
    fully_shard(model, reshard_after_forward=False)
    return model


def _timed(fn: Callable[[], None]) -> tuple[float, float]:
    dist.barrier()
    start, cpu = time.perf_counter(), time.process_time()
    fn()
    t = torch.tensor([time.perf_counter() - start])
    cpu = time.process_time() - cpu
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item(), cpu


def _rank(rank: int, world: int, cfg: dict) -> dict | None:
    width, layers = cfg["width"], cfg["layers"]
    x = torch.randn(cfg["tokens"], width, generator=torch.Generator().manual_seed(rank))
    plain = build(width, layers, False)
    ddp = nn.parallel.DistributedDataParallel(build(width, layers, False))
    immediate = shard(build(width, layers, False))
    delayed = shard(build(width, layers, True))
    defer_fsdp_reduction(delayed)
    background = shard(build(width, layers, True))
    handle = defer_fsdp_reduction(background, mode="async")
    flat = torch.zeros(layers * width * width)
    shard_out = torch.empty(flat.numel() // world)
    order: dict[str, float] = {"under_w": 0.0, "total": 0.0, "after_w": 0, "steps": 0}

    def step(model: nn.Module, split: bool) -> Callable[[], None]:
        def run() -> None:
            model.zero_grad()
            model(x).square().mean().backward()
            if split:
                splitgrad.backward_dw(model)

        return run

    def step_background() -> None:
        background.zero_grad()
        background(x).square().mean().backward()
        splitgrad.backward_dw(background)
        w_end = time.perf_counter()
        handle.finish()
        for _, start, end in handle.pop_comm_events():
            order["under_w"] += max(0.0, min(end, w_end) - start)
            order["total"] += end - start
            order["after_w"] += end > w_end
        order["steps"] += 1

    def comm_alone() -> None:
        dist.all_gather_into_tensor(flat, shard_out)
        dist.reduce_scatter_tensor(shard_out, flat)

    def rs_alone() -> None:
        dist.reduce_scatter_tensor(shard_out, flat)

    variants = {
        "compute (no comm)": step(plain, False),
        "comm alone": comm_alone,
        "RS alone": rs_alone,
        "torch DDP": step(ddp, False),
        "FSDP2 immediate": step(immediate, False),
        "FSDP2 delayed, RS in last W (mode='last_w')": step(delayed, True),
        ASYNC: step_background,
    }
    samples: dict[str, list[float]] = {k: [] for k in variants}
    cpu: dict[str, list[float]] = {k: [] for k in variants}
    names = list(variants)
    for i in range(cfg["warmup"] + cfg["samples"]):
        if i == cfg["warmup"]:
            order.update(under_w=0.0, total=0.0, after_w=0, steps=0)
        for name in names[i % len(names) :] + names[: i % len(names)]:
            t, c = _timed(variants[name])
            if i >= cfg["warmup"]:
                samples[name].append(t)
                cpu[name].append(c)
    handle.remove()
    if rank != 0:
        return None
    return {
        "wall": {k: statistics.median(v) for k, v in samples.items()},
        "cpu": {k: statistics.median(v) for k, v in cpu.items()},
        "order": order,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=512, help="tokens per rank per step")
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    out = spawn(_rank, 2, vars(args), timeout=3600, threads=1)[0]
    med, cpu, order = out["wall"], out["cpu"], out["order"]
    compute, comm = med["compute (no comm)"], med["comm alone"]
    print(
        f"2 gloo ranks x 1 thread, {args.layers} x Linear({args.width}, {args.width}) fp32, {args.tokens} tokens/rank, "
        f"reshard_after_forward=False, {args.samples} samples; medians (ms)\n"
    )
    print("| variant | step (ms) | rank-0 CPU (ms) | ratio vs torch DDP | exposed comm (ms) | comm hidden |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, t in med.items():
        if name in ("compute (no comm)", "comm alone", "RS alone"):
            print(f"| {name} | {1e3 * t:.1f} | {1e3 * cpu[name]:.1f} | | | |")
            continue
        exposed = t - compute
        hidden = "" if name == "torch DDP" else f"{100 * max(0.0, 1 - exposed / comm):.0f} %"
        print(
            f"| {name} | {1e3 * t:.1f} | {1e3 * cpu[name]:.1f} | {t / med['torch DDP']:.3f} | {1e3 * exposed:.1f} "
            f"| {hidden} |"
        )
    steps = max(1, order["steps"])
    share = order["under_w"] / order["total"] if order["total"] else 0.0
    print(
        f"\n{ASYNC}, rank 0, own clock: RS under W = {100 * share:.0f} % of the background reduce-scatter time; "
        f"{order['after_w'] / steps:.1f} of {args.layers} reduce-scatters per step still running when backward_dw returned"
    )


if __name__ == "__main__":
    main()
