"""Step time of splitgrad's DistributedDataParallel vs torch's, and how much reduction it hides.

Two gloo ranks on this machine (one compute thread each) train the same MLP of splitgrad Linear layers:

* ``torch DDP``: ``torch.nn.parallel.DistributedDataParallel`` on the model in plain-autograd mode;
* ``splitgrad DDP, immediate``: our wrapper, same model (gradients through autograd hooks);
* ``splitgrad DDP, delayed``: ``delay_wgrad_compute=True``, ``backward()`` then ``splitgrad.backward_dw``
  (gradients through the wgrad hooks), unfused and fused into ``main_grad``.

Per variant, in interleaved rounds, three timings (each the max over ranks, median over steps):

* ``step``: zero, forward, backward (+ backward_dw), finish_grad_sync — the real step;
* ``compute``: the same inside ``no_sync()`` and without finishing: compute plus hook bookkeeping, no
  reduction at all;
* ``reduce``: ``finish_grad_sync()`` right after a ``compute`` step: every bucket reduced with nothing to
  overlap — the reduction time alone.

``exposed = step - compute`` is the reduction time the step still pays; ``hidden = 1 - exposed / reduce``.

Run: ``.venv/bin/python benchmarks/bench_ddp.py`` (``--help`` for sizes).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

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


def _timed(fn: Callable[[], None]) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    elapsed = torch.tensor([time.perf_counter() - start])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # a data-parallel step lasts as long as its slowest rank
    return elapsed.item()


def _rank(rank: int, world: int, cfg: dict) -> dict[str, dict[str, float]] | None:
    width, layers, tokens = cfg["width"], cfg["layers"], cfg["tokens"]
    bucket_size = cfg["bucket_mb"] * 2**20 // 4
    x = torch.randn(tokens, width, generator=torch.Generator().manual_seed(rank))

    def loss(model: nn.Module) -> torch.Tensor:
        return model(x).square().mean()

    torch_model = build(width, layers, delay=False, fused=False)
    theirs = nn.parallel.DistributedDataParallel(torch_model, bucket_cap_mb=cfg["bucket_mb"])
    ours: dict[str, DistributedDataParallel] = {}
    for name, delay, fused in (
        ("immediate", False, False),
        ("delayed", True, False),
        ("delayed+fused", True, True),
    ):
        ours[name] = DistributedDataParallel(
            build(width, layers, delay=delay, fused=fused), bucket_size=bucket_size
        )

    def torch_step() -> None:
        theirs.zero_grad()
        loss(theirs).backward()

    def torch_compute() -> None:
        theirs.zero_grad()
        with theirs.no_sync():
            loss(theirs).backward()

    def backward_dw(ddp: DistributedDataParallel) -> None:
        # no_grad: the core runs wgrad tasks with grad mode on (reported); it must not build a graph.
        with torch.no_grad():
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

    times: dict[str, dict[str, list[float]]] = {"torch DDP": {"step": [], "compute": []}}
    for name in ours:
        times[name] = {"step": [], "compute": [], "reduce": []}
    for round_ in range(cfg["rounds"] + 1):
        record = round_ > 0  # round 0 warms up allocator, threads and gloo connections
        for _ in range(cfg["steps"]):
            for kind, fn in (("step", torch_step), ("compute", torch_compute)):
                t = _timed(fn)
                if record:
                    times["torch DDP"][kind].append(t)
            for name, ddp in ours.items():
                t_step = _timed(lambda ddp=ddp: our_step(ddp))
                t_compute = _timed(lambda ddp=ddp: our_compute(ddp))
                t_reduce = _timed(ddp.finish_grad_sync)
                if record:
                    times[name]["step"].append(t_step)
                    times[name]["compute"].append(t_compute)
                    times[name]["reduce"].append(t_reduce)
    if rank:
        return None
    return {name: {k: statistics.median(v) for k, v in kinds.items()} for name, kinds in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=256, help="tokens per rank per step")
    parser.add_argument("--bucket-mb", type=int, default=4, help="bucket size (MiB of float32), both DDPs")
    parser.add_argument("--steps", type=int, default=5, help="steps per variant per round")
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    cfg = vars(args)
    medians = spawn(_rank, 2, cfg, timeout=1800, threads=1)[0]

    base = medians["torch DDP"]["step"]
    print(
        f"2 gloo ranks x 1 thread, {args.layers} x Linear({args.width}, {args.width}), {args.tokens} tokens/rank, "
        f"{args.bucket_mb} MiB buckets; medians of {args.steps * args.rounds} steps"
    )
    print(
        f"{'variant':<26}{'step ms':>9}{'vs torch':>10}{'compute ms':>12}{'reduce ms':>11}{'exposed ms':>12}{'hidden':>8}"
    )
    for name, m in medians.items():
        exposed = m["step"] - m["compute"]
        reduce_ = m.get("reduce")
        hidden = "" if reduce_ is None else f"{100 * min(1.0, max(0.0, 1 - exposed / reduce_)):.0f} %"
        label = name if name == "torch DDP" else f"splitgrad DDP, {name}"
        print(
            f"{label:<26}{1e3 * m['step']:>9.1f}{m['step'] / base:>10.3f}{1e3 * m['compute']:>12.1f}"
            f"{'' if reduce_ is None else f'{1e3 * reduce_:.1f}':>11}{1e3 * exposed:>12.1f}{hidden:>8}"
        )


if __name__ == "__main__":
    main()
