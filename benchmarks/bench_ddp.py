"""Step time of splitgrad's DistributedDataParallel vs torch's, how much reduction each hides, and how much
it could.

Two gloo ranks (one compute thread each) train the same MLP of splitgrad Linear layers:

* ``torch DDP``: ``torch.nn.parallel.DistributedDataParallel`` on the model in plain-autograd mode;
* ``splitgrad DDP, immediate``: our wrapper, same model (gradients through autograd hooks);
* ``immediate+fused``: ``fuse_wgrad_accumulation=True``: each layer's backward adds its weight gradient into
  ``main_grad`` itself (gradients through the wgrad hooks, fired inside backward);
* ``delayed`` / ``delayed+fused``: ``delay_wgrad_compute=True``, ``backward()`` then ``splitgrad.backward_dw``
  (gradients through the wgrad hooks, fired in ``backward_dw``); and ``delayed, no overlap``
  (``overlap_grad_reduce=False``: every bucket reduced in ``finish_grad_sync``) for comparison.

Each sample times every variant (in rotated order) three ways, each the max over the two ranks:

* ``step``: zero, forward, backward (+ backward_dw), finish_grad_sync — the real step;
* ``compute``: the same inside ``no_sync()`` and without finishing: compute plus hook bookkeeping, no
  reduction at all; it also records when each bucket's gradients are ready (``_ddp_coverage.ArrivalClock``);
* ``reduce``: every bucket reduced with nothing to overlap (ours: ``finish_grad_sync()`` right after a
  ``compute`` step; torch DDP: its bucket sizes, pre-divided and all-reduced the same way) — the reduction
  time alone.

``exposed = step - compute`` is the reduction time the step still pays; ``hidden = 1 - exposed / reduce``.
``coverable`` is the most of ``reduce`` the compute after each bucket's ready time could hide (buckets reduced
one after another on one link, each started when ready; defined in ``_ddp_coverage``), ``hid/cov`` = hidden
reduction time / coverable time: how close a variant comes to what its launch points allow. ``cpu ratio``
compares the CPU time of a step (both processes, all threads), which load disturbs less than wall time.
``--trace`` prints, per variant, where in the backward each bucket became ready (% of the backward compute
still to come), and the link model's finish times: the event order, which load does not change.

Measure overlap only where communication takes wall time but little CPU (a rate-limited loopback namespace):
``python benchmarks/_netns.py --rate 4gbit -- .venv/bin/python benchmarks/bench_ddp.py --samples 8``.
On plain loopback a gloo all-reduce is CPU work and, on 2 cores, cannot hide behind compute.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch
import torch.distributed as dist
from torch import nn

import splitgrad
from _ddp_coverage import ArrivalClock, coverable, link_times, torch_ddp_buckets
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


VARIANTS = (  # name, delay_wgrad_compute, fuse_wgrad_accumulation, overlap_grad_reduce
    ("immediate", False, False, True),
    ("immediate+fused", False, True, True),
    ("delayed", True, False, True),
    ("delayed+fused", True, True, True),
    ("delayed, no overlap", True, False, False),
)


def _rank(rank: int, world: int, cfg: dict) -> dict | None:
    width, layers, tokens = cfg["width"], cfg["layers"], cfg["tokens"]
    bucket_size = cfg["bucket_mb"] * 2**20 // 4
    x = torch.randn(tokens, width, generator=torch.Generator().manual_seed(rank))

    def loss(model: nn.Module) -> torch.Tensor:
        return model(x).square().mean()

    torch_model = build(width, layers, delay=False, fused=False)
    theirs = nn.parallel.DistributedDataParallel(torch_model, bucket_cap_mb=cfg["bucket_mb"])
    ours = {
        name: DistributedDataParallel(
            build(width, layers, delay=delay, fused=fused),
            bucket_size=bucket_size,
            overlap_grad_reduce=overlap,
        )
        for name, delay, fused, overlap in VARIANTS
    }
    clocks = {"torch DDP": ArrivalClock(torch_model)} | {n: ArrivalClock(d.module) for n, d in ours.items()}

    def torch_run(sync: bool) -> None:
        theirs.zero_grad()
        with contextlib.nullcontext() if sync else theirs.no_sync():
            out = loss(theirs)
            clocks["torch DDP"].start()
            out.backward()
        clocks["torch DDP"].stop(at_last_arrival=sync)

    def our_run(name: str, sync: bool) -> None:
        ddp = ours[name]
        ddp.zero_grad_buffer()
        with contextlib.nullcontext() if sync else ddp.no_sync():
            out = loss(ddp)
            clocks[name].start()
            out.backward()
            splitgrad.backward_dw(ddp)
        clocks[name].stop()
        if sync:
            ddp.finish_grad_sync()

    for _ in range(3):  # torch DDP rebuilds its buckets at the second step and logs them at the third
        torch_run(True)
    torch_buckets = torch_ddp_buckets(theirs)
    flat = [torch.zeros(sum(p.numel() for p in b)) for b in torch_buckets]

    def torch_reduce() -> None:
        # What torch's reducer does per bucket, with nothing to overlap: pre-divide, async all-reduce, wait.
        works = []
        for t in flat:
            t.div_(world)
            works.append(dist.all_reduce(t, async_op=True))
        for work in works:
            work.wait()

    buckets = {"torch DDP": torch_buckets} | {n: [list(b.params) for b in d.buckets] for n, d in ours.items()}
    variants = {"torch DDP": (partial(torch_run, True), partial(torch_run, False), torch_reduce)}
    for name, ddp in ours.items():
        variants[name] = (partial(our_run, name, True), partial(our_run, name, False), ddp.finish_grad_sync)
    kinds = ("step", "compute", "reduce", "cpu", "reduce cpu", "ready", "end", "step ready", "step end")
    times: dict = {name: {k: [] for k in kinds} for name in variants}
    names = list(variants)
    for sample in range(cfg["warmup"] + cfg["samples"]):
        # Rotate the order so no variant always runs right after the same neighbour.
        for name in names[sample % len(names) :] + names[: sample % len(names)]:
            step, compute, reduce_ = variants[name]
            clock, cpu = clocks[name], []
            measured = {"step": _timed(step, cpu)}
            measured["step ready"], measured["step end"] = _ready(clock, buckets[name])
            measured["compute"] = _timed(compute)
            measured["ready"], measured["end"] = _ready(clock, buckets[name])
            measured["cpu"] = cpu[0]
            # Ours: the buffers hold the compute step's unreduced gradients.
            measured["reduce"] = _timed(reduce_, cpu)
            measured["reduce cpu"] = cpu[1]
            if sample >= cfg["warmup"]:
                for kind, t in measured.items():
                    times[name][kind].append(t)
    bucket_bytes = {n: [sum(4 * p.numel() for p in b) for b in bs] for n, bs in buckets.items()}
    for clock in clocks.values():
        clock.remove()
    return {"times": times, "bucket_bytes": bucket_bytes} if rank == 0 else None


def _ready(clock: ArrivalClock, buckets: list[list[nn.Parameter]]) -> tuple[list[float], float]:
    """Bucket ready times and the compute end of the step just run, each the max over the ranks (s)."""
    ready = torch.tensor([*clock.ready_times(buckets), clock.end], dtype=torch.float64)
    dist.all_reduce(ready, op=dist.ReduceOp.MAX)
    return ready[:-1].tolist(), ready[-1].item()


def summarize(results: dict) -> dict[str, dict[str, float]]:
    """Medians of per-sample values: step, compute, reduce, exposed (step - compute), coverable, and the
    step-time ratio to torch DDP measured in the same sample (paired medians resist drifting machine load)."""
    times = results["times"]
    base = times["torch DDP"]
    out = {}
    for name, t in times.items():
        cover = [
            coverable(r, link_times(results["bucket_bytes"][name], red), e)[0]
            for r, e, red in zip(t["ready"], t["end"], t["reduce"])
        ]
        hidden_s = [red - (s - c) for s, c, red in zip(t["step"], t["compute"], t["reduce"])]
        row = {
            "step": statistics.median(t["step"]),
            "compute": statistics.median(t["compute"]),
            "exposed": statistics.median(s - c for s, c in zip(t["step"], t["compute"])),
            "ratio": statistics.median(s / b for s, b in zip(t["step"], base["step"])),
            "cpu ratio": statistics.median(c / b for c, b in zip(t["cpu"], base["cpu"])),
            "reduce": statistics.median(t["reduce"]),
            "reduce cpu": statistics.median(t["reduce cpu"]),
            "coverable": statistics.median(c / r for c, r in zip(cover, t["reduce"])),
            "hid/cov": statistics.median(
                h / c if c > 1e-3 * red else float("nan") for h, c, red in zip(hidden_s, cover, t["reduce"])
            ),
        }
        row["hidden"] = min(1.0, max(0.0, 1.0 - row["exposed"] / row["reduce"]))
        out[name] = row
    return out


def trace(results: dict) -> list[str]:
    """Per variant, the last sample's event order: where in backward each bucket became ready / launched."""
    lines = []
    for name, t in results["times"].items():
        link = link_times(results["bucket_bytes"][name], t["reduce"][-1])
        for kind, ready, end in (
            ("no-sync", t["ready"][-1], t["end"][-1]),
            ("step", t["step ready"][-1], t["step end"][-1]),
        ):
            left = " ".join(f"{100 * (1 - r / end):.0f}" for r in ready)
            _, finish = coverable(ready, link, end)
            # Under the link model, how many earlier reductions are still running when each bucket is ready.
            queued = max(sum(f > r for f in finish[:k]) for k, r in enumerate(ready))
            lines.append(
                f"{name:<22} {kind:<8} backward {1e3 * end:6.1f} ms; % of it left when each bucket was ready: "
                f"{left}; link model: last reduction ends at {100 * finish[-1] / end:.0f} % of it, "
                f"at most {queued} reduction(s) queued ahead of a new one"
            )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=256, help="tokens per rank per step")
    parser.add_argument("--bucket-mb", type=int, default=4, help="bucket size (MiB of float32), both DDPs")
    parser.add_argument("--samples", type=int, default=20, help="measured samples (each times every variant)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--trace", action="store_true", help="print where in backward each bucket was ready")
    args = parser.parse_args()
    results = spawn(_rank, 2, vars(args), timeout=3600, threads=1)[0]
    rows = summarize(results)
    print(
        f"2 gloo ranks x 1 thread, {args.layers} x Linear({args.width}, {args.width}), {args.tokens} tokens/rank, "
        f"{args.bucket_mb} MiB buckets, {args.samples} samples; medians (ms), ratio = median of paired ratios"
    )
    header = ("variant", "step", "ratio", "cpu ratio", "compute", "reduce", "(cpu)", "exposed", "hidden")
    header += ("coverable", "hid/cov")
    print(f"{header[0]:<36}" + "".join(f"{h:>10}" for h in header[1:]))
    for name, r in rows.items():
        label = name if name == "torch DDP" else f"splitgrad DDP, {name}"
        cells = [
            f"{1e3 * r['step']:.1f}",
            f"{r['ratio']:.3f}",
            f"{r['cpu ratio']:.3f}",
            f"{1e3 * r['compute']:.1f}",
        ]
        cells += [f"{1e3 * r['reduce']:.1f}", f"{1e3 * r['reduce cpu']:.1f}", f"{1e3 * r['exposed']:.1f}"]
        cells += [f"{100 * r[k]:.0f} %" for k in ("hidden", "coverable", "hid/cov")]
        print(f"{label:<36}" + "".join(f"{c:>10}" for c in cells))
    if args.trace:
        print("\n".join(trace(results)))


if __name__ == "__main__":
    main()
