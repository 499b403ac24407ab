"""Pipeline schedules on 2 CPU ranks: splitgrad's runtime vs torch.distributed.pipelining, same model and data.

Run: ``.venv/bin/python benchmarks/bench_pipeline.py [--quick]`` (defaults: 4 MLP blocks H=512, FFN 4H, 8
microbatches of 1024 tokens, float32; 2 gloo ranks x 1 thread; a few minutes).

Variants, each on 2-D activations ``(tokens, H)`` and again on 3-D ``(batch, seq, H)``:

* ``torch 1F1B`` / ``torch InterleavedZB`` / ``torch ZBV``: PyTorch's schedules on plain ``nn.Linear`` blocks
  (PyTorch splits I/W itself; on 3-D it raises "Can't detach views in-place", reported as such);
* ``torch <ZB> + adapter``: the same PyTorch schedules on ``splitgrad.Linear(delay_wgrad_compute=True)``
  blocks through :func:`splitgrad.pipeline.torch_adapter.splitgrad_pipeline_stage` (W = splitgrad bundles);
* ``splitgrad 1f1b`` / ``zb-h1`` / ``zbv``: splitgrad's own runtime on the splitgrad blocks;
* ``reference``: the whole model on one rank, microbatch after microbatch (plain autograd), the other idle.

1F1B and zb-h1 cut the model into 2 stages of 2 blocks, the interleaved/V schedules into 4 stages of 1.

What is measured (every variant in one 2-rank spawn, timed round-robin so machine drift hits all alike):

* step time: barrier, step, barrier on every rank; the median over rounds. tokens/s = tokens per step / that.
* efficiency = reference step time / (2 x step time) (1.0 = perfect 2-way pipelining of the same work).
* step peak memory per rank: the highest resident set size sampled every 2 ms during the step minus the RSS
  just before it (MiB). The ranks run with ``MALLOC_MMAP_THRESHOLD_=65536`` so every tensor above 64 KiB is
  its own mapping, returned to the OS when freed: RSS then follows live tensors (activations, saved graph,
  wgrad operands, gradients) instead of allocator high-water marks.
* measured bubble: ``(span - compute) / span`` of the rank with the longest compute span, from per-action
  timings (splitgrad's runtime timeline; PyTorch's stage calls wrapped), as ``splitgrad.pipeline.measure``.
* a second table: median per-action times (F, B = input grad, W, BW = full backward) — the profile that
  explains a gap between variants.
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import splitgrad
from splitgrad.pipeline import TimelineEvent
from splitgrad.pipeline.build import build_runtime
from splitgrad.pipeline.measure import gather_events, measured_bubble_ratio, simulate_measured
from splitgrad.pipeline.torch_adapter import splitgrad_pipeline_stage
from splitgrad.testing import SpawnError, spawn

TORCH_SCHEDULES = ("1F1B", "InterleavedZB", "ZBV")
SPLITGRAD_SCHEDULES = ("1f1b", "zb-h1", "zbv")
DETACH_BUG = "Can't detach views in-place"


@dataclass(kw_only=True, slots=True)
class BenchConfig:
    """Model, data and measurement sizes."""

    hidden: int = 512
    """Model width H."""
    ffn: int = 2048
    """Inner width of each MLP block."""
    n_blocks: int = 4
    """MLP blocks in the model (cut into 2 or 4 stages)."""
    n_microbatches: int = 8
    """Microbatches per step."""
    tokens: int = 1024
    """Tokens per microbatch."""
    seq: int = 256
    """Sequence length of the 3-D variants: microbatches are ``(tokens // seq, seq, hidden)``."""
    rounds: int = 3
    """Timed steps per variant."""
    warmup: int = 1
    """Untimed steps per variant first."""

    def __post_init__(self) -> None:
        if self.n_blocks % 4 or self.tokens % self.seq or min(self.rounds, self.hidden, self.ffn) < 1:
            raise ValueError(f"need n_blocks % 4 == 0, tokens % seq == 0, positive sizes; got {self}")


class MLPBlock(nn.Module):
    """``fc2(gelu(fc1(x)))``; no residual, so on 3-D input the block's output is a view (see the docs)."""

    def __init__(self, cfg: BenchConfig, split: bool) -> None:
        super().__init__()
        make = (lambda i, o: splitgrad.Linear(i, o, delay_wgrad_compute=True)) if split else nn.Linear
        self.fc1 = make(cfg.hidden, cfg.ffn)
        self.fc2 = make(cfg.ffn, cfg.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


def cut(cfg: BenchConfig, split: bool, n_stages: int) -> list[nn.Sequential]:
    torch.manual_seed(0)
    blocks = [MLPBlock(cfg, split) for _ in range(cfg.n_blocks)]
    per = cfg.n_blocks // n_stages
    return [nn.Sequential(*blocks[s * per : (s + 1) * per]) for s in range(n_stages)]


def batch(cfg: BenchConfig, three_d: bool) -> tuple[torch.Tensor, torch.Tensor]:
    n = cfg.n_microbatches * cfg.tokens
    shape = (n // cfg.seq, cfg.seq, cfg.hidden) if three_d else (n, cfg.hidden)
    g = torch.Generator().manual_seed(1)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


# -- variants: each .step() runs one training step's forward/backward and returns this rank's events ---------
class TorchVariant:
    """A PyTorch schedule on plain blocks (``adapter=False``) or on splitgrad blocks through the adapter."""

    def __init__(self, cfg: BenchConfig, schedule: str, three_d: bool, *, adapter: bool, rank: int) -> None:
        from torch.distributed.pipelining import (
            PipelineStage,
            Schedule1F1B,
            ScheduleInterleavedZeroBubble,
            ScheduleZBVZeroBubble,
        )

        n_stages = 2 if schedule == "1F1B" else 4
        mine = {"1F1B": [rank], "InterleavedZB": [rank, rank + 2], "ZBV": [rank, 3 - rank]}[schedule]
        modules = cut(cfg, adapter, n_stages)
        self.local = [modules[s] for s in sorted(mine)]
        stages = []
        for s in sorted(mine):
            if adapter:
                stage = splitgrad_pipeline_stage(modules[s], s, n_stages, "cpu")
            else:
                stage = PipelineStage(modules[s], s, n_stages, torch.device("cpu"))
            self._time(stage, s)
            stages.append(stage)
        loss = F.mse_loss
        if schedule == "1F1B":
            self.schedule = Schedule1F1B(stages[0], cfg.n_microbatches, loss_fn=loss)
        else:
            cls = ScheduleInterleavedZeroBubble if schedule == "InterleavedZB" else ScheduleZBVZeroBubble
            self.schedule = cls(stages, cfg.n_microbatches, loss_fn=loss)
        self.first, self.last = 0 in mine, n_stages - 1 in mine
        self.x, self.y = batch(cfg, three_d)
        self.rank, self.events, self.t0 = rank, [], 0.0

    def _time(self, stage, s: int) -> None:
        def wrap(fn: Callable, kind_of: Callable[..., str]) -> Callable:
            def timed(mb: int, *args, **kwargs):
                start = time.perf_counter()
                out = fn(mb, *args, **kwargs)
                kind = kind_of(*args, **kwargs)
                now = time.perf_counter()
                self.events.append(
                    TimelineEvent(self.rank, f"{s}{kind}{mb}", start - self.t0, now - self.t0, kind, s, mb)
                )
                return out

            return timed

        stage.forward_one_chunk = wrap(stage.forward_one_chunk, lambda *a, **k: "F")
        stage.backward_one_chunk = wrap(
            stage.backward_one_chunk, lambda *a, full_backward=True, **k: "BW" if full_backward else "B"
        )
        stage.backward_weight_one_chunk = wrap(stage.backward_weight_one_chunk, lambda *a, **k: "W")

    def zero_grad(self) -> None:
        for m in self.local:
            m.zero_grad(set_to_none=True)

    def step(self) -> list[TimelineEvent]:
        self.events, self.t0 = [], time.perf_counter()
        kwargs = {"target": self.y} if self.last else {}
        self.schedule.step(*((self.x,) if self.first else ()), **kwargs)
        return self.events


class SplitgradVariant:
    """splitgrad's runtime running one of its schedules on splitgrad blocks."""

    def __init__(self, cfg: BenchConfig, schedule: str, three_d: bool, *, rank: int) -> None:
        n_stages = 4 if schedule == "zbv" else 2
        self.rt = build_runtime(
            cut(cfg, True, n_stages), schedule, loss_fn=F.mse_loss, n_microbatches=cfg.n_microbatches
        )
        self.x, self.y = batch(cfg, three_d)

    @property
    def schedule(self):
        return self.rt.schedule

    def zero_grad(self) -> None:
        self.rt.zero_grad()

    def step(self) -> list[TimelineEvent]:
        return self.rt.step(self.x, self.y).events


class ReferenceVariant:
    """The whole model in one process (rank 0; rank 1 waits): the single-process compute of the same work."""

    def __init__(self, cfg: BenchConfig, three_d: bool, *, rank: int) -> None:
        self.model = nn.Sequential(*cut(cfg, False, 1)) if rank == 0 else None
        self.x, self.y = batch(cfg, three_d)
        self.m = cfg.n_microbatches

    def zero_grad(self) -> None:
        if self.model is not None:
            self.model.zero_grad(set_to_none=True)

    def step(self) -> list[TimelineEvent]:
        if self.model is not None:
            for xm, ym in zip(self.x.chunk(self.m), self.y.chunk(self.m), strict=True):
                (F.mse_loss(self.model(xm), ym) / self.m).backward()
        return []


# -- measurement ------------------------------------------------------------------------------------------------
class RssSampler:
    """Background thread sampling this process's resident set size every ``interval`` seconds."""

    def __init__(self, interval: float = 0.002) -> None:
        self.interval, self.peak, self._stop = interval, 0, threading.Event()
        self._page = os.sysconf("SC_PAGE_SIZE")
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def rss(self) -> int:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * self._page

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, self.rss())

    def reset(self) -> int:
        """Start a new peak window; returns the current RSS (the baseline)."""
        self.peak = now = self.rss()
        return now

    def close(self) -> None:
        self._stop.set()


def build_variants(cfg: BenchConfig, rank: int) -> dict[str, object]:
    variants: dict[str, object] = {}
    for three_d in (False, True):
        tag = "3-D" if three_d else "2-D"
        variants[f"{tag}|reference (1 process)"] = ReferenceVariant(cfg, three_d, rank=rank)
        for name in TORCH_SCHEDULES:
            if not (three_d and name != "1F1B"):  # PyTorch's own split fails there: see native_attempt
                variants[f"{tag}|torch {name}"] = TorchVariant(cfg, name, three_d, adapter=False, rank=rank)
        for name in TORCH_SCHEDULES[1:]:
            variants[f"{tag}|torch {name} + adapter"] = TorchVariant(
                cfg, name, three_d, adapter=True, rank=rank
            )
        for name in SPLITGRAD_SCHEDULES:
            variants[f"{tag}|splitgrad {name}"] = SplitgradVariant(cfg, name, three_d, rank=rank)
    return variants


def run_rank(rank: int, world: int, cfg_fields: dict) -> dict:
    cfg = BenchConfig(**cfg_fields)
    sampler = RssSampler()
    held_b_to_w = b_to_w_memory(cfg) if rank == 0 else None
    dist.barrier()
    variants = build_variants(cfg, rank)
    retained: dict[str, int] = {}
    samples: dict[str, list[tuple]] = {k: [] for k in variants}
    try:
        for round_no in range(cfg.warmup + cfg.rounds):
            for key, variant in variants.items():
                variant.zero_grad()
                dist.barrier()
                base = sampler.reset()
                start = time.perf_counter()
                events = variant.step()
                dist.barrier()
                elapsed = time.perf_counter() - start
                if round_no == 0:
                    # What the variant keeps from one step to the next (receive buffers, their gradients,
                    # caches); a later step may free it first, so it is added to every step's peak.
                    variant.zero_grad()
                    retained[key] = max(sampler.rss() - base, 0)
                merged = gather_events(events, dst=0)
                if round_no >= cfg.warmup:
                    peak = max(sampler.peak - base, 0) + retained[key]
                    simulated = None
                    if merged and isinstance(variant, SplitgradVariant):
                        simulated = simulate_measured(merged, variant.schedule).bubble_ratio
                    samples[key].append((elapsed, peak, merged, simulated))
    finally:
        sampler.close()
    return {"samples": samples, "retained": retained, "held_b_to_w": held_b_to_w}


def b_to_w_memory(cfg: BenchConfig) -> dict[str, float]:
    """MiB held after F and after the input-gradient backward of one microbatch through one 2-block stage.

    ``torch I``: PyTorch's own I step (``stage_backward_input``, a private function, imported here only to
    measure it): the autograd graph is retained for W plus the gradients at the weight branch points.
    ``splitgrad B``: the adapter's and runtime's B: plain backward inside ``capture_wgrad``.
    """
    sampler = RssSampler(interval=3600.0)  # only explicit reads
    x0, dy = torch.randn(cfg.tokens, cfg.hidden), torch.randn(cfg.tokens, cfg.hidden)
    out: dict[str, float] = {}
    for name in ("torch I", "splitgrad B") * 2:  # the second pass is the one kept (allocator warm)
        # In a function so that everything of one pass is freed before the next pass's baseline.
        after_f, after_b = _one_microbatch(cfg, name, sampler, x0, dy)
        out[f"{name} after F"], out[f"{name} after B"] = after_f / 2**20, after_b / 2**20
    sampler.close()
    return out


def _one_microbatch(
    cfg: BenchConfig, name: str, sampler: RssSampler, x0: torch.Tensor, dy: torch.Tensor
) -> tuple[int, int]:
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    stage = cut(cfg, name.startswith("splitgrad"), cfg.n_blocks // 2)[0]
    base = sampler.rss()
    x = x0.detach().requires_grad_()
    y = stage(x)
    after_f = sampler.rss() - base
    if name == "torch I":
        _, groups = stage_backward_input([y], [dy], [x], stage.parameters())
        after_b = sampler.rss() - base
        stage_backward_weight(stage.parameters(), groups)
    else:
        with splitgrad.capture_wgrad() as bundle:
            torch.autograd.backward(y, dy)
        after_b = sampler.rss() - base
        bundle.run()
    return after_f, after_b


def native_attempt(rank: int, world: int, cfg_fields: dict, schedule: str) -> str:
    """One step of PyTorch's own I/W split on plain blocks with 3-D activations (expected to raise)."""
    TorchVariant(BenchConfig(**cfg_fields), schedule, True, adapter=False, rank=rank).step()
    return "ran"


def _rank_compute(events: list[TimelineEvent]) -> dict[int, float]:
    """Seconds of compute events per rank."""
    out: dict[int, float] = {}
    for e in events:
        if e.is_compute:
            out[e.rank] = out.get(e.rank, 0.0) + e.end - e.start
    return out


# -- report -----------------------------------------------------------------------------------------------------
def summarize(cfg: BenchConfig, results: list[dict]) -> dict[str, dict]:
    rows: dict[str, dict] = {}
    tokens = cfg.n_microbatches * cfg.tokens
    for key, per_round in results[0]["samples"].items():
        step = statistics.median(s[0] for s in per_round)
        peaks = [max(s[1] for s in r["samples"][key]) / 2**20 for r in results]
        events = [e for s in per_round for e in (s[2] or [])]
        bubbles = [measured_bubble_ratio(s[2]) for s in per_round if s[2]]
        simulated = [s[3] for s in per_round if s[3] is not None]
        busiest = [max(_rank_compute(s[2]).values()) for s in per_round if s[2]]
        kinds = {k: [(e.end - e.start) * 1e3 for e in events if e.kind == k] for k in ("F", "B", "W", "BW")}
        rows[key] = {
            "step": step,
            "tok_s": tokens / step,
            "peaks": peaks,
            "bubble": statistics.median(bubbles) if bubbles else None,
            "simulated": statistics.median(simulated) if simulated else None,
            "compute": statistics.median(busiest) if busiest else None,
            "kinds": {k: (statistics.median(v) if v else None) for k, v in kinds.items()},
            "held": [r["retained"][key] / 2**20 for r in results],
        }
    for key, row in rows.items():
        ref = rows[key.split("|")[0] + "|reference (1 process)"]["step"]
        row["eff"] = ref / (2 * row["step"])
    return rows


def print_report(
    cfg: BenchConfig, rows: dict[str, dict], native: dict[str, str], b_to_w: dict[str, float], load: list
) -> None:
    print(f"\nPipeline step, 2 gloo ranks x 1 thread: {asdict(cfg)}")
    cores = os.cpu_count()
    print(f"machine: {cores} cores; 1/5/15-min load average before / after: {load[0]} / {load[1]}\n")
    head = "| act. | variant | median step (s) | tokens/s | efficiency | step peak MiB r0 / r1 | (held) | bubble |"
    print(head)
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for key, r in rows.items():
        tag, name = key.split("|")
        bubble = "-" if r["bubble"] is None else f"{r['bubble']:.3f}"
        eff = "(1 rank)" if name.startswith("reference") else f"{r['eff']:.3f}"
        peaks = " / ".join(f"{p:.0f}" for p in r["peaks"])
        held = " / ".join(f"{p:.0f}" for p in r["held"])
        print(
            f"| {tag} | {name} | {r['step']:.3f} | {r['tok_s']:,.0f} | {eff} | {peaks} | {held} | {bubble} |"
        )
    for name, outcome in native.items():
        print(f"| 3-D | torch {name} | {outcome} | | | | | |")
    print(
        "\n(held): of the step peak, MiB a variant keeps from one step to the next (receive buffers, caches)."
    )
    print(
        "\nProfile: per-action medians (ms; B = input-gradient backward, BW = full backward); compute (s) of"
    )
    print(
        "the busiest rank per step vs half the reference step (the ideal); bubble simulated at measured costs\n"
    )
    print(
        "| act. | variant | F | B | W | BW | busiest-rank compute (s) | / (reference / 2) | simulated bubble |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for key, r in rows.items():
        if r["bubble"] is not None:
            cells = " | ".join("-" if v is None else f"{v:.1f}" for v in r["kinds"].values())
            half_ref = rows[key.split("|")[0] + "|reference (1 process)"]["step"] / 2
            sim = "-" if r["simulated"] is None else f"{r['simulated']:.3f}"
            print(
                f"| {' | '.join(key.split('|'))} | {cells} | {r['compute']:.3f} | {r['compute'] / half_ref:.2f}"
                f" | {sim} |"
            )
    print(
        f"\nOne microbatch through one {cfg.n_blocks // 2}-block stage, single process (MiB above the start):\n"
    )
    print("| | after F | after B / I (held until W) |")
    print("|---|---:|---:|")
    for name in ("torch I", "splitgrad B"):
        print(f"| {name} | {b_to_w[name + ' after F']:.1f} | {b_to_w[name + ' after B']:.1f} |")
    ratio = b_to_w["splitgrad B after B"] / b_to_w["torch I after B"]
    print("\nTargets")
    print(f"- memory held from B to W, splitgrad / PyTorch: {ratio:.2f} (target < 1)")
    for tag in ("2-D", "3-D"):

        def row(name: str, tag: str = tag) -> dict:
            return rows[f"{tag}|{name}"]

        zb_tp = max(
            (row(n)["tok_s"] for n in ("torch InterleavedZB", "torch ZBV") if f"{tag}|{n}" in rows),
            default=None,
        )
        for name in ("splitgrad zb-h1", "splitgrad zbv"):
            vs = f", throughput / best torch ZB = {row(name)['tok_s'] / zb_tp:.3f}" if zb_tp else ""
            print(f"- {tag} {name}: efficiency {row(name)['eff']:.3f} (target >= 0.95){vs}")
        bubble = row("splitgrad zb-h1")["bubble"] / row("splitgrad 1f1b")["bubble"]
        print(f"- {tag} measured bubble splitgrad zb-h1 / 1f1b = {bubble:.3f} (target <= 0.4)")
        pairs = [(f"splitgrad {n}", f"torch {t}") for n, t in (("1f1b", "1F1B"), ("zbv", "ZBV"))]
        pairs += [(f"torch {t} + adapter", f"torch {t}") for t in ("InterleavedZB", "ZBV")]
        for ours, theirs in pairs:
            if f"{tag}|{theirs}" in rows:
                ratio = " / ".join(f"{a / b:.2f}" for a, b in zip(row(ours)["peaks"], row(theirs)["peaks"]))
                print(f"- {tag} step peak memory {ours} / {theirs}, r0 / r1: {ratio}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny smoke configuration (seconds of compute)")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds for the whole 2-rank run")
    args = parser.parse_args()
    quick = dict(hidden=64, ffn=256, tokens=128, seq=32, rounds=2, warmup=1)
    cfg = BenchConfig(**(quick if args.quick else {}))
    if args.rounds is not None:
        cfg.rounds = args.rounds
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # read by the ranks' malloc at start (see the docstring)
    native: dict[str, str] = {}
    for name in TORCH_SCHEDULES[1:]:
        try:
            spawn(native_attempt, 2, asdict(cfg), name, timeout=300, pg_timeout=60)
            native[name] = "ran"
        except SpawnError as exc:
            text = str(exc) + "".join(f.traceback + f.message for f in exc.failures)
            native[name] = (
                f"fails: {DETACH_BUG}" if DETACH_BUG in text else f"fails: {exc.failures[0].message[:80]}"
            )
    load_before = tuple(round(v, 1) for v in os.getloadavg())
    results = spawn(run_rank, 2, asdict(cfg), timeout=args.timeout, pg_timeout=600)
    load_after = tuple(round(v, 1) for v in os.getloadavg())
    rows = summarize(cfg, results)
    print_report(cfg, rows, native, results[0]["held_b_to_w"], [load_before, load_after])


if __name__ == "__main__":
    main()
