"""Step time of splitgrad's DistributedDataParallel vs torch's, and how much reduction it hides.

Two gloo ranks on this machine (one compute thread each) train the same MLP of splitgrad Linear layers:

* ``torch DDP``: ``torch.nn.parallel.DistributedDataParallel`` on the model in plain-autograd mode;
* ``splitgrad DDP, immediate``: our wrapper, same model (gradients through autograd hooks);
* ``splitgrad DDP, delayed``: ``delay_wgrad_compute=True``, ``backward()`` then ``splitgrad.backward_dw``
  (gradients through the wgrad hooks), unfused and fused into ``main_grad``; and with
  ``overlap_grad_reduce=False`` (every bucket reduced in ``finish_grad_sync``) for comparison.

Each sample times every variant (in rotated order) three ways, each the max over the two ranks:

* ``step``: zero, forward, backward (+ backward_dw), finish_grad_sync — the real step;
* ``compute``: the same inside ``no_sync()`` and without finishing: compute plus hook bookkeeping, no
  reduction at all;
* ``reduce``: ``finish_grad_sync()`` right after a ``compute`` step: every bucket reduced with nothing to
  overlap — the reduction time alone.

``exposed = step - compute`` is the reduction time the step still pays; ``hidden = 1 - exposed / reduce``.
``cpu ratio`` compares the CPU time of a step (both processes, all threads: compute, hooks, gloo), which a
shared machine's load disturbs less than wall time; ``(cpu)`` is the CPU time of the reduction alone. When it
is close to ``reduce``, the reduction is CPU work: on a machine without idle cores (2 ranks on 2 cores) it
competes with compute instead of hiding behind it.

Run: ``.venv/bin/python benchmarks/bench_ddp.py`` (``--help`` for sizes).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch
import torch.distributed as dist
from torch import nn

import splitgrad
from splitgrad.parallel import DistributedDataParallel
from splitgrad.testing import spawn


def build(width: int, layers: int, *, delay: bool, fused: bool) -> nn.Module:
    torch.manual_seed(0)
    mods: list[nn.Module] = []
    for _ in range(layers):
        mods += [
            splitgrad.Linear(width, width, delay_wgrad_compute=delay, fuse_wgrad_accumulation=fused),
            nn.Tanh(),
        ]
    return nn.Sequential(*mods)


def _timed(fn: Callable[[], None], cpu: list[float] | None = None) -> float:
    """Wall time of ``fn`` (max over ranks); appends the mean CPU time of the two processes to ``cpu``."""
    dist.barrier()
    start, start_cpu = time.perf_counter(), time.process_time()
    fn()
    elapsed = torch.tensor([time.perf_counter() - start, time.process_time() - start_cpu])
    dist.all_reduce(
        elapsed[:1], op=dist.ReduceOp.MAX
    )  # a data-parallel step lasts as long as its slowest rank
    dist.all_reduce(elapsed[1:])
    if cpu is not None:
        cpu.append(elapsed[1].item() / dist.get_world_size())
    return elapsed[0].item()


def _rank(rank: int, world: int, cfg: dict) -> dict[str, dict[str, list[float]]] | None:
    width, layers, tokens = cfg["width"], cfg["layers"], cfg["tokens"]
    bucket_size = cfg["bucket_mb"] * 2**20 // 4
    x = torch.randn(tokens, width, generator=torch.Generator().manual_seed(rank))

    def loss(model: nn.Module) -> torch.Tensor:
        return model(x).square().mean()

    torch_model = build(width, layers, delay=False, fused=False)
    theirs = nn.parallel.DistributedDataParallel(torch_model, bucket_cap_mb=cfg["bucket_mb"])
    ours: dict[str, DistributedDataParallel] = {}
    for name, delay, fused, overlap in (
        ("immediate", False, False, True),
        ("delayed", True, False, True),
        ("delayed+fused", True, True, True),
        ("delayed, no overlap", True, False, False),
    ):
        ours[name] = DistributedDataParallel(
            build(width, layers, delay=delay, fused=fused),
            bucket_size=bucket_size,
            overlap_grad_reduce=overlap,
        )

    def torch_step() -> None:
        theirs.zero_grad()
        loss(theirs).backward()

    def torch_compute() -> None:
        theirs.zero_grad()
        with theirs.no_sync():
            loss(theirs).backward()

    def backward_dw(ddp: DistributedDataParallel) -> None:
        splitgrad.backward_dw(ddp)

    def our_compute(ddp: DistributedDataParallel) -> None:
        ddp.zero_grad_buffer()
        with ddp.no_sync():
            loss(ddp).backward()
            backward_dw(ddp)

    def our_step(ddp: DistributedDataParallel) -> None:
        ddp.zero_grad_buffer()
        loss(ddp).backward()
        backward_dw(ddp)
        ddp.finish_grad_sync()

    variants: dict[str, tuple[Callable[[], None], Callable[[], None], Callable[[], None] | None]] = {
        "torch DDP": (torch_step, torch_compute, None)
    }
    for name, ddp in ours.items():
        variants[name] = (partial(our_step, ddp), partial(our_compute, ddp), ddp.finish_grad_sync)
    times: dict[str, dict[str, list[float]]] = {
        name: {"step": [], "compute": [], "reduce": [], "cpu": [], "reduce cpu": []} for name in variants
    }
    names = list(variants)
    for sample in range(cfg["warmup"] + cfg["samples"]):
        # Rotate the order so no variant always runs right after the same neighbour.
        for name in names[sample % len(names) :] + names[: sample % len(names)]:
            step, compute, reduce_ = variants[name]
            cpu: list[float] = []
            measured = {"step": _timed(step, cpu), "compute": _timed(compute)}
            measured["cpu"] = cpu[0]
            if reduce_ is not None:
                # The buffers hold the compute step's unreduced gradients.
                measured["reduce"] = _timed(reduce_, cpu)
                measured["reduce cpu"] = cpu[1]
            if sample >= cfg["warmup"]:
                for kind, t in measured.items():
                    times[name][kind].append(t)
    return times if rank == 0 else None


def summarize(times: dict[str, dict[str, list[float]]]) -> dict[str, dict[str, float]]:
    """Medians of per-sample values: step, compute, reduce, exposed (step - compute) and the step-time ratio
    to torch DDP measured in the same sample (the medians of paired values resist drifting machine load)."""
    base = times["torch DDP"]["step"]
    out = {}
    for name, t in times.items():
        row = {
            "step": statistics.median(t["step"]),
            "compute": statistics.median(t["compute"]),
            "exposed": statistics.median(s - c for s, c in zip(t["step"], t["compute"])),
            "ratio": statistics.median(s / b for s, b in zip(t["step"], base)),
            "cpu ratio": statistics.median(c / b for c, b in zip(t["cpu"], times["torch DDP"]["cpu"])),
        }
        if t["reduce"]:
            row["reduce"] = statistics.median(t["reduce"])
            row["reduce cpu"] = statistics.median(t["reduce cpu"])
            row["hidden"] = min(1.0, max(0.0, 1.0 - row["exposed"] / row["reduce"]))
        out[name] = row
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=256, help="tokens per rank per step")
    parser.add_argument("--bucket-mb", type=int, default=4, help="bucket size (MiB of float32), both DDPs")
    parser.add_argument("--samples", type=int, default=20, help="measured samples (each times every variant)")
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    times = spawn(_rank, 2, vars(args), timeout=3600, threads=1)[0]
    rows = summarize(times)
    print(
        f"2 gloo ranks x 1 thread, {args.layers} x Linear({args.width}, {args.width}), {args.tokens} tokens/rank, "
        f"{args.bucket_mb} MiB buckets, {args.samples} samples; medians (ms), ratio = median of paired ratios"
    )
    header = ("variant", "step", "ratio", "cpu ratio", "compute", "reduce", "(cpu)", "exposed", "hidden")
    print(f"{header[0]:<36}" + "".join(f"{h:>10}" for h in header[1:]))
    for name, r in rows.items():
        label = name if name == "torch DDP" else f"splitgrad DDP, {name}"
        cells = [
            f"{1e3 * r['step']:.1f}",
            f"{r['ratio']:.3f}",
            f"{r['cpu ratio']:.3f}",
            f"{1e3 * r['compute']:.1f}",
        ]
        cells += [f"{1e3 * r[k]:.1f}" if k in r else "-" for k in ("reduce", "reduce cpu")]
        cells += [f"{1e3 * r['exposed']:.1f}"]
        cells += [f"{100 * r['hidden']:.0f} %" if "hidden" in r else "-"]
        print(f"{label:<36}" + "".join(f"{c:>10}" for c in cells))


if __name__ == "__main__":
    main()
