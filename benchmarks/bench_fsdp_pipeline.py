"""Pipeline x FSDP2 (pp=2 x fsdp=2, 4 gloo ranks, ``zb-h1``): the deferred reduce-scatter run by the ``RF``
action (``FSDPStage(reduction="finish")``) vs started in the background at each group's last W
(``reduction="async"``).

Run inside the rate-limited loopback namespace (see ``benchmarks/_netns.py``)::

    python benchmarks/_netns.py --rate 4gbit -- .venv/bin/python benchmarks/bench_fsdp_pipeline.py --samples 6

Per variant: the step's median wall time (max over ranks); and, from each rank's own measured timeline (one
clock per process, so the figures are ratios of intervals that ran side by side): the reduce-scatter time,
the share of it that ran while the rank was computing (``F``/``B``/``W`` events), and the median ``RF`` action
(the blocking part at the end of the step). ``"finish"`` runs every reduce-scatter inside ``RF`` (0 % under
compute by construction); the background mode moves them under the remaining ``W`` work.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

import splitgrad
from splitgrad.parallel import FSDPStage
from splitgrad.pipeline import build_runtime, pipeline_groups
from splitgrad.pipeline.runtime import sequential_stages
from splitgrad.testing import spawn

PP, DP = 2, 2


def _overlap(a: tuple[float, float], spans: list[tuple[float, float]]) -> float:
    return sum(max(0.0, min(a[1], e) - max(a[0], s)) for s, e in spans)


def _rank(rank: int, world: int, cfg: dict) -> dict | None:
    g = pipeline_groups(pp_size=PP, dp_size=DP)
    mesh = DeviceMesh.from_group(g.dp_group, "cpu")
    width, n_mb = cfg["width"], cfg["microbatches"]
    gen = torch.Generator().manual_seed(g.dp_rank)
    x = torch.randn(n_mb * cfg["tokens"], width, generator=gen)
    t = torch.randn(n_mb * cfg["tokens"], width, generator=gen)
    out = {}
    for reduction in ("finish", "async"):
        torch.manual_seed(0)
        layers: list[nn.Module] = []
        for _ in range(PP * cfg["layers"]):
            layers += [splitgrad.Linear(width, width, delay_wgrad_compute=True), nn.Tanh()]
        wrapped = []
        for stage in sequential_stages(layers, PP):
            for layer in stage:
                if isinstance(layer, splitgrad.Linear):
                    fully_shard(layer, mesh=mesh, reshard_after_forward=False)
            fully_shard(stage, mesh=mesh, reshard_after_forward=False)
            wrapped.append(FSDPStage(stage, reduction=reduction))
        rt = build_runtime(
            wrapped, "zb-h1", n_microbatches=n_mb, loss_fn=nn.functional.mse_loss, pp_group=g.pp_group
        )
        steps, rs_total, rs_under, rf = [], 0.0, 0.0, []
        for i in range(cfg["warmup"] + cfg["samples"]):
            rt.zero_grad()
            dist.barrier()
            start = time.perf_counter()
            result = rt.step(x, t)
            wall = torch.tensor([time.perf_counter() - start])
            dist.all_reduce(wall, op=dist.ReduceOp.MAX)
            if i < cfg["warmup"]:
                continue
            steps.append(wall.item())
            compute = [(e.start, e.end) for e in result.events if e.kind in ("F", "B", "W", "BW")]
            for e in result.events:
                if e.kind == "grad-sync":
                    rs_total += e.end - e.start
                    rs_under += _overlap((e.start, e.end), compute)
                if e.name.endswith("RF"):
                    rf.append(e.end - e.start)
        rt.close()
        out[reduction] = {
            "step": statistics.median(steps),
            "rs_ms": 1e3 * rs_total / cfg["samples"],
            "under": rs_under / rs_total if rs_total else 0.0,
            "rf_ms": 1e3 * statistics.median(rf),
        }
        for w in wrapped:
            w.reduction.remove()
    return {"pp_rank": g.pp_rank, "dp_rank": g.dp_rank, **out}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=2, help="Linear layers per stage (one FSDP group each)")
    parser.add_argument("--tokens", type=int, default=256, help="tokens per microbatch")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--samples", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=1)
    args = parser.parse_args()
    results = spawn(_rank, PP * DP, vars(args), timeout=3600, threads=1)
    print(
        f"pp={PP} x fsdp={DP} gloo ranks x 1 thread, zb-h1, {PP} x {args.layers} x Linear({args.width}, "
        f"{args.width}) fp32, {args.microbatches} microbatches x {args.tokens} tokens, {args.samples} samples\n"
    )
    print(
        "| reduction | step (ms, median, max over ranks) | rank | RS per step (ms) | RS under compute | RF (ms) |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for reduction in ("finish", "async"):
        for r in sorted(results, key=lambda r: (r["pp_rank"], r["dp_rank"])):
            m = r[reduction]
            print(
                f"| {reduction} | {1e3 * m['step']:.1f} | pp{r['pp_rank']}/dp{r['dp_rank']} | {m['rs_ms']:.1f} "
                f"| {100 * m['under']:.0f} % | {m['rf_ms']:.1f} |"
            )


if __name__ == "__main__":
    main()
