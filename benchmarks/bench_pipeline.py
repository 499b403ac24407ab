"""Pipeline schedules on 2 CPU ranks: splitgrad's runtime vs torch.distributed.pipelining, same model and data.

Run: ``.venv/bin/python benchmarks/bench_pipeline.py [--quick]`` (defaults: 4 MLP blocks H=512, FFN 4H, 8
microbatches of 1024 tokens, float32; 2 gloo ranks x 1 thread; about 6 minutes on 2 idle cores).

Variants, each on 2-D activations ``(tokens, H)`` and again on 3-D ``(batch, seq, H)``:

* ``torch 1F1B`` / ``torch InterleavedZB`` / ``torch ZBV``: PyTorch's schedules on plain ``nn.Linear`` blocks
  (PyTorch splits I/W itself; on 3-D it raises "Can't detach views in-place", reported as such);
* ``torch <ZB> + adapter``: the same PyTorch schedules on ``splitgrad.Linear(delay_wgrad_compute=True)``
  blocks through :func:`splitgrad.pipeline.torch_adapter.splitgrad_pipeline_stage` (W = splitgrad bundles);
* ``splitgrad 1f1b`` / ``zb-h1`` / ``zbv``: splitgrad's own runtime on the splitgrad blocks;
* ``reference (1 process)``: the whole model on one rank, microbatch after microbatch (plain autograd), the
  other rank idle.

1F1B and zb-h1 cut the model into 2 stages of 2 blocks, the interleaved/V schedules into 4 stages of 1.

What is measured, in two 2-rank spawns (every variant in each, run round-robin so drift hits all alike):

* timing spawn (glibc's default allocator): step time = barrier, step, barrier on every rank, median over
  rounds; tokens/s; efficiency = single-process reference / (2 x step time), as the issue defines it, and
  again against ``reference, both ranks at once`` (each rank runs the whole single-process step at the same
  time: the compute speed of two busy cores, so that column isolates bubble and transfers); measured
  bubble ``(span - compute) / span`` of the longest-span rank from per-action timings (splitgrad's timeline;
  PyTorch's stage calls wrapped), as ``splitgrad.pipeline.measure``; a profile table of per-action medians.
* memory spawn (``MALLOC_MMAP_THRESHOLD_=65536``: every tensor above 64 KiB is its own mapping, returned to
  the OS when freed, so the resident set follows live tensors; it slows allocation, hence the separate
  spawn): step peak per rank = the highest RSS sampled every 2 ms during a step minus the RSS before it,
  plus what the variant keeps from one step to the next (receive buffers, their gradients, caches: measured
  around its first step, and shown as "held"). Also one microbatch through one stage in a single process:
  what PyTorch's own I and splitgrad's B leave alive until W.

The last table reads off issue 13 item 5 in one run: per splitgrad schedule and activation rank, the
measured bubble next to the simulated one at the measured per-stage costs (target: within 0.01), the
throughput over PyTorch's best zero-bubble variant of the same activations (native or through the adapter;
the median over rounds of the per-round ratio; target >= 1.00), and the receive buffers the runtime held
posted ahead (rank 0). Next to it, each step replayed at its own per-action durations
(:func:`splitgrad.pipeline.replay.replay_measured`: the simulator's engine without the compute jitter a
median-cost simulation cannot see): measured - replay is the runtime's
overhead, split on the longest-span rank into dispatch / transport / propagated ms per step
(:func:`~splitgrad.pipeline.replay.overhead_split`), and rank 0's runtime CPU per action outside the handlers
(``StepResult.runtime_cpu``). On a shared machine run it in the rate-limited namespace: ``python
benchmarks/_netns.py --rate 4gbit -- .venv/bin/python benchmarks/bench_pipeline.py``; ``--quick`` (tiny
sizes, about a minute) only proves it runs.

``--head-to-head`` times only splitgrad ``zbv`` and PyTorch's zero-bubble variants (16 rounds by default, no
memory spawn, about 6 minutes): per PyTorch variant, splitgrad's throughput over it paired by round (median,
quartiles, and in how many rounds splitgrad was faster), then the realisation table. Fewer variants per
round make many more rounds affordable, which the throughput target needs on a noisy machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import splitgrad
from splitgrad.pipeline.runtime import build_runtime
from splitgrad.pipeline.runtime.recording import gather_events
from splitgrad.pipeline.timeline import (
    TimelineEvent,
    measured_bubble_ratio,
    overhead_split,
    replay_measured,
    simulate_measured,
)
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
        result = self.rt.step(self.x, self.y)
        self.recv_peak = result.comm.peak_recv_bytes if result.comm is not None else 0
        self.runtime_cpu = result.runtime_cpu / len(self.rt.actions)
        return result.events


class ReferenceVariant:
    """The whole model in one process, microbatch after microbatch: on rank 0 only, or on both ranks at once."""

    def __init__(self, cfg: BenchConfig, three_d: bool, *, rank: int, both: bool = False) -> None:
        self.model = nn.Sequential(*cut(cfg, False, 1)) if rank == 0 or both else None
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


REF, REF2 = "reference (1 process)", "reference, both ranks at once"


def build_variants(cfg: BenchConfig, rank: int, head_to_head: bool = False) -> dict[str, object]:
    """Every variant; ``head_to_head``: only splitgrad ``zbv`` and PyTorch's zero-bubble schedules (the others
    are not built: no models, stages or runtimes for variants the run does not time)."""
    makers: dict[str, Callable[[], object]] = {}
    for three_d in (False, True):
        tag = "3-D" if three_d else "2-D"
        makers[f"{tag}|{REF}"] = partial(ReferenceVariant, cfg, three_d, rank=rank)
        makers[f"{tag}|{REF2}"] = partial(ReferenceVariant, cfg, three_d, rank=rank, both=True)
        for name in TORCH_SCHEDULES:
            if not (three_d and name != "1F1B"):  # PyTorch's own split fails there: see native_attempt
                makers[f"{tag}|torch {name}"] = partial(
                    TorchVariant, cfg, name, three_d, adapter=False, rank=rank
                )
        for name in TORCH_SCHEDULES[1:]:
            makers[f"{tag}|torch {name} + adapter"] = partial(
                TorchVariant, cfg, name, three_d, adapter=True, rank=rank
            )
        for name in SPLITGRAD_SCHEDULES:
            makers[f"{tag}|splitgrad {name}"] = partial(SplitgradVariant, cfg, name, three_d, rank=rank)
    return {
        key: make()
        for key, make in makers.items()
        if not head_to_head or key.endswith("splitgrad zbv") or ("torch" in key and "ZB" in key)
    }


def run_rank(rank: int, world: int, cfg_fields: dict, memory: bool, head_to_head: bool = False) -> dict:
    """Every variant (``head_to_head``: see :func:`build_variants`), round-robin, each round starting one
    variant later (no variant always runs right after the same neighbour); ``memory``: sample RSS (1 measured
    step) instead of timing."""
    cfg = BenchConfig(**cfg_fields)
    sampler = RssSampler() if memory else None
    b_to_w = b_to_w_memory(cfg) if memory and rank == 0 else None
    if memory:  # one-off lazy allocations (thread pools, BLAS buffers) must not count as a variant's "held"
        ReferenceVariant(cfg, False, rank=rank, both=True).step()
    variants = build_variants(cfg, rank, head_to_head)
    held: dict[str, int] = {}
    samples: dict[str, list[tuple]] = {k: [] for k in variants}
    keys = list(variants)
    try:
        for round_no in range(cfg.warmup + (1 if memory else cfg.rounds)):
            shift = round_no % len(keys)
            for key in keys[shift:] + keys[:shift]:
                variant = variants[key]
                variant.zero_grad()
                dist.barrier()
                base = sampler.reset() if sampler else 0
                start = time.perf_counter()
                events = variant.step()
                dist.barrier()
                elapsed = time.perf_counter() - start
                if sampler and round_no == 0:
                    variant.zero_grad()
                    held[key] = max(sampler.rss() - base, 0)
                if round_no < cfg.warmup:
                    continue
                if sampler:
                    samples[key].append(max(sampler.peak - base, 0) + held[key])
                    continue
                merged = gather_events(events, dst=0)
                simulated, recv_peak, realised = None, None, None
                if isinstance(variant, SplitgradVariant):
                    recv_peak = variant.recv_peak
                    if merged:
                        simulated = simulate_measured(merged, variant.schedule).bubble_ratio
                        realised = realisation(merged, variant.schedule, variant.runtime_cpu)
                samples[key].append((elapsed, merged, simulated, recv_peak, realised))
    finally:
        if sampler:
            sampler.close()
    return {"samples": samples, "held": held, "b_to_w": b_to_w}


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


def realisation(events: list[TimelineEvent], schedule, runtime_cpu: float) -> dict[str, float]:
    """One step replayed at its own per-action durations, and the longest-span rank's overhead split (ms).

    ``runtime_cpu``: rank 0's CPU seconds per action outside the handlers (``StepResult.runtime_cpu``).
    """
    replay = replay_measured(events, schedule)
    split = overhead_split(events, schedule, replay)
    critical = max(range(len(split)), key=lambda r: split[r].span)
    worst = split[critical]
    return {
        "replay": replay.bubble_ratio,
        "rank": critical,
        "dispatch": 1e3 * worst.dispatch,
        "transport": 1e3 * worst.transport,
        "propagated": 1e3 * worst.propagated,
        "overhead": 1e3 * worst.overhead,
        "cpu_us": 1e6 * runtime_cpu,
    }


def _rank_compute(events: list[TimelineEvent]) -> dict[int, float]:
    """Seconds of compute events per rank."""
    out: dict[int, float] = {}
    for e in events:
        if e.is_compute:
            out[e.rank] = out.get(e.rank, 0.0) + e.end - e.start
    return out


# -- report -----------------------------------------------------------------------------------------------------
def summarize(cfg: BenchConfig, timing: list[dict], memory: list[dict]) -> dict[str, dict]:
    rows: dict[str, dict] = {}
    for key, per_round in timing[0]["samples"].items():
        step = statistics.median(s[0] for s in per_round)
        runs = [s[1] for s in per_round if s[1]]
        events = [e for run in runs for e in run]
        kinds = {k: [(e.end - e.start) * 1e3 for e in events if e.kind == k] for k in ("F", "B", "W", "BW")}
        backward: dict[int, list[float]] = {}
        for e in events:
            if e.kind in ("B", "BW"):
                backward.setdefault(e.stage, []).append((e.end - e.start) * 1e3)
        simulated = [s[2] for s in per_round if s[2] is not None]
        rows[key] = {
            "step": step,
            "steps": [s[0] for s in per_round],  # by round: variants ran round-robin, so rounds pair up
            "tok_s": cfg.n_microbatches * cfg.tokens / step,
            "bubble": statistics.median(measured_bubble_ratio(run) for run in runs) if runs else None,
            "simulated": statistics.median(simulated) if simulated else None,
            "compute": statistics.median(max(_rank_compute(run).values()) for run in runs) if runs else None,
            "kinds": {k: (statistics.median(v) if v else None) for k, v in kinds.items()},
            "b_per_stage": [statistics.median(backward[st]) for st in sorted(backward)],
            "peaks": [max(r["samples"][key]) / 2**20 for r in memory],
            # Receive buffers posted ahead and not yet used, at most (rank 0; splitgrad's runtime only).
            "recv_held": max((s[3] for s in per_round if s[3] is not None), default=None),
            "held": [r["held"][key] / 2**20 for r in memory],
            # Replay at the measured per-action durations and the overhead split: medians over rounds.
            "realised": _median_fields([s[4] for s in per_round if s[4] is not None]),
        }
    for key, row in rows.items():
        tag = key.split("|")[0]
        if f"{tag}|{REF}" in rows:  # not in a head-to-head run
            row["eff"] = rows[f"{tag}|{REF}"]["step"] / (2 * row["step"])
            row["eff2"] = rows[f"{tag}|{REF2}"]["step"] / (2 * row["step"])
    return rows


def _median_fields(dicts: list[dict[str, float]]) -> dict[str, float] | None:
    """Field-wise median of equally keyed dicts (None when there are none)."""
    if not dicts:
        return None
    return {
        k: (statistics.median_low if k == "rank" else statistics.median)(d[k] for d in dicts)
        for k in dicts[0]
    }


def _cells(values, fmt: str) -> str:
    return " / ".join("-" if v is None else format(v, fmt) for v in values)


def print_report(
    cfg: BenchConfig, rows: dict[str, dict], native: dict[str, str], b_to_w: dict, load: list
) -> None:
    print(f"\nPipeline step, 2 gloo ranks x 1 thread: {asdict(cfg)}")
    print(
        f"machine: {os.cpu_count()} cores; load average (1/5/15 min) before / after: {load[0]} / {load[1]}\n"
    )
    print(
        "| act. | variant | median step (s) | tokens/s | efficiency | eff. vs both-busy ref. | bubble "
        "| step peak MiB r0 / r1 | (held) |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for key, r in rows.items():
        tag, name = key.split("|")
        effs = ("-", "-") if name.startswith("reference") else (f"{r['eff']:.3f}", f"{r['eff2']:.3f}")
        print(
            f"| {tag} | {name} | {r['step']:.3f} | {r['tok_s']:,.0f} | {effs[0]} | {effs[1]} "
            f"| {_cells([r['bubble']], '.3f')} | {_cells(r['peaks'], '.0f')} | {_cells(r['held'], '.0f')} |"
        )
    for name, outcome in native.items():
        print(f"| 3-D | torch {name} | {outcome} | | | | | | |")
    print(
        "\nProfile: per-action medians (ms); B or BW per stage (ms); compute of the busiest rank per step vs"
    )
    print(
        "half the single-process reference; splitgrad's schedules simulated at the measured per-stage costs\n"
    )
    print(
        "| act. | variant | F | B | W | BW | B or BW per stage | busiest-rank compute (s) | / (ref. / 2) "
        "| simulated bubble |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for key, r in rows.items():
        if r["compute"] is None:
            continue
        half = rows[key.split("|")[0] + f"|{REF}"]["step"] / 2
        kinds = " | ".join(_cells([v], ".1f") for v in r["kinds"].values())
        print(
            f"| {' | '.join(key.split('|'))} | {kinds} | {_cells(r['b_per_stage'], '.0f')} | {r['compute']:.3f} "
            f"| {r['compute'] / half:.2f} | {_cells([r['simulated']], '.3f')} |"
        )
    print(
        f"\nOne microbatch through one {cfg.n_blocks // 2}-block stage, one process (MiB above the start)\n"
    )
    print("| | after F | after B / I (alive until W) |\n|---|---:|---:|")
    for name in ("torch I", "splitgrad B"):
        print(f"| {name} | {b_to_w[name + ' after F']:.1f} | {b_to_w[name + ' after B']:.1f} |")
    print("\nTargets")
    print(
        f"- alive from B to W, splitgrad / PyTorch: {b_to_w['splitgrad B after B'] / b_to_w['torch I after B']:.2f}"
    )
    for tag in ("2-D", "3-D"):
        row = {k.split("|")[1]: v for k, v in rows.items() if k.startswith(tag)}
        for name in ("splitgrad zb-h1", "splitgrad zbv"):
            print(
                f"- {tag} {name}: efficiency {row[name]['eff']:.3f} (>= 0.95?), vs both-busy reference "
                f"{row[name]['eff2']:.3f}"
            )
        bubble = row["splitgrad zb-h1"]["bubble"] / row["splitgrad 1f1b"]["bubble"]
        print(f"- {tag} measured bubble splitgrad zb-h1 / 1f1b: {bubble:.3f} (<= 0.4?)")
        pairs = [("splitgrad 1f1b", "torch 1F1B"), ("splitgrad zbv", "torch ZBV")]
        pairs += [(f"torch {t} + adapter", f"torch {t}") for t in ("InterleavedZB", "ZBV")]
        for ours, theirs in pairs:
            if theirs in row:
                ratio = _cells([a / b for a, b in zip(row[ours]["peaks"], row[theirs]["peaks"])], ".2f")
                print(f"- {tag} step peak memory {ours} / {theirs}, r0 / r1: {ratio}")


def print_realisation(rows: dict[str, dict]) -> None:
    """Issue 13 item 5, read off one run: per splitgrad schedule, measured bubble within 0.01 of the simulated
    one (at the measured per-stage costs), and throughput at least PyTorch's best zero-bubble schedule on the
    same work (2-D: native or through the adapter; 3-D: through the adapter, PyTorch's own split fails): the
    best by median step time, and the ratio the median over rounds of that round's step-time ratio.

    Next to it, the step replayed at its own per-action durations (:func:`splitgrad.pipeline.replay.replay_measured`):
    measured - replay is the runtime's overhead without compute jitter, split on the longest-span rank into
    dispatch (idle with every input produced: Python between actions), transport (in a receive wait after the
    producer had finished) and propagated (waiting beyond the replay's for a producer delayed on its own rank);
    dispatch + transport + propagated = measured span - replay span. Medians over rounds, ms per step."""
    print(
        "\nRealising the simulator (targets: measured - simulated <= 0.010; throughput / best torch ZB >= 1.00)\n"
    )
    print(
        "| act. | variant | measured bubble | simulated (measured costs) | measured - simulated "
        "| throughput / best torch ZB | best torch ZB | receive buffers held, rank 0 (MiB) | replay bubble "
        "| measured - replay | overhead on rank: dispatch / transport / propagated (ms per step) "
        "| runtime CPU per action, rank 0 (us) |"
    )
    print("|---|---|---:|---:|---:|---:|---|---:|---:|---:|---|---:|")
    for tag in ("2-D", "3-D"):
        row = {k.split("|")[1]: v for k, v in rows.items() if k.startswith(tag)}
        zb = {n: r["tok_s"] for n, r in row.items() if n.startswith("torch") and "ZB" in n}
        best = max(zb, key=zb.get) if zb else None
        for name in (n for n in row if n.startswith("splitgrad")):
            r = row[name]
            gap = None if None in (r["bubble"], r["simulated"]) else r["bubble"] - r["simulated"]
            # Paired by round (each round ran every variant once, back to back): drift between rounds cancels.
            ratio = statistics.median(t / o for t, o in zip(row[best]["steps"], r["steps"])) if best else None
            held = None if r["recv_held"] is None else r["recv_held"] / 2**20
            real = r["realised"] or {}
            replay = real.get("replay")
            beyond = None if None in (r["bubble"], replay) else r["bubble"] - replay
            split = (
                f"r{real['rank']}: {real['dispatch']:.1f} / {real['transport']:.1f} / {real['propagated']:+.1f}"
                if real
                else "-"
            )
            print(
                f"| {tag} | {name} | {_cells([r['bubble']], '.3f')} | {_cells([r['simulated']], '.3f')} "
                f"| {_cells([gap], '+.3f')} | {_cells([ratio], '.3f')} | {best or '-'} | {_cells([held], '.1f')} "
                f"| {_cells([replay], '.3f')} | {_cells([beyond], '+.3f')} | {split} "
                f"| {_cells([real.get('cpu_us')], '.0f')} |"
            )


def print_head_to_head(cfg: BenchConfig, rows: dict[str, dict]) -> None:
    """splitgrad ``zbv`` against every PyTorch zero-bubble variant of the same activations, paired by round."""
    print(
        f"\nHead to head, 2 gloo ranks x 1 thread: {asdict(cfg)}; load average now {os.getloadavg()[0]:.1f}\n"
    )
    print(
        "| act. | variant | median step (s) | measured bubble | splitgrad zbv throughput / this (paired median) "
        "| (quartiles) | rounds splitgrad faster |"
    )
    print("|---|---|---:|---:|---:|---:|---:|")
    for tag in ("2-D", "3-D"):
        row = {k.split("|")[1]: v for k, v in rows.items() if k.startswith(tag)}
        ours = row["splitgrad zbv"]["steps"]
        for name, r in row.items():
            ratios = [t / o for t, o in zip(r["steps"], ours)]
            cells = "-", "-", "-"
            if name != "splitgrad zbv":
                q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
                faster = sum(x > 1 for x in ratios)
                cells = (
                    f"{statistics.median(ratios):.3f}",
                    f"[{q[0]:.3f}, {q[2]:.3f}]",
                    f"{faster} / {len(ratios)}",
                )
            print(
                f"| {tag} | {name} | {r['step']:.3f} | {_cells([r['bubble']], '.3f')} | {cells[0]} | {cells[1]} "
                f"| {cells[2]} |"
            )
    print_realisation(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny smoke configuration (seconds of compute)")
    parser.add_argument("--rounds", type=int, default=None, help="timed steps per variant")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per 2-rank spawn")
    parser.add_argument(
        "--head-to-head",
        action="store_true",
        help="only splitgrad zbv and PyTorch's zero-bubble variants, timing only, paired throughput table "
        "(default 16 rounds)",
    )
    args = parser.parse_args()
    cfg = BenchConfig(**(dict(hidden=64, ffn=256, tokens=128, seq=32, rounds=2) if args.quick else {}))
    if args.head_to_head and not args.quick:
        cfg.rounds = 16
    if args.rounds is not None:
        cfg.rounds = args.rounds
    if args.head_to_head:
        timing = spawn(run_rank, 2, asdict(cfg), False, True, timeout=args.timeout, pg_timeout=600)
        rows = summarize(cfg, timing, [])
        print_head_to_head(cfg, rows)
        return
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
    load = [tuple(round(v, 1) for v in os.getloadavg())]
    os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
    timing = spawn(run_rank, 2, asdict(cfg), False, timeout=args.timeout, pg_timeout=600)
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # read by the ranks' malloc at start-up
    memory = spawn(run_rank, 2, asdict(cfg), True, timeout=args.timeout, pg_timeout=600)
    load.append(tuple(round(v, 1) for v in os.getloadavg()))
    rows = summarize(cfg, timing, memory)
    print_report(cfg, rows, native, memory[0]["b_to_w"], load)
    print_realisation(rows)


if __name__ == "__main__":
    main()
