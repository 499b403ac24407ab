"""The model, data and variants the pipeline benchmarks time, each on 2 CPU ranks or in one process.

* ``torch 1F1B`` / ``torch InterleavedZB`` / ``torch ZBV``: PyTorch's schedules on plain ``nn.Linear`` blocks
  (PyTorch splits I/W itself; on 3-D activations it raises "Can't detach views in-place");
* ``torch <ZB> + adapter``: the same schedules on ``splitgrad.Linear(delay_wgrad_compute=True)`` blocks
  through :func:`splitgrad.pipeline.torch_adapter.splitgrad_pipeline_stage` (W = splitgrad bundles);
* ``splitgrad 1f1b`` / ``zb-h1`` / ``zbv`` / ``v-half`` / ``v-min``: splitgrad's own runtime on the splitgrad
  blocks (the V families on 4 stages; at 2 ranks V-Half and V-Min hold what ``zbv`` holds, 4 half-stages);
* ``reference``: the whole model in one process, microbatch after microbatch (plain autograd), on rank 0
  only or on both ranks at once.

Each variant's ``step()`` runs one training step's forward and backward on this rank and returns its timeline
events (PyTorch's stage calls are wrapped to record them). Used by ``bench_pipeline.py``,
``bench_pipeline_head_to_head.py``, ``diag_pipeline_comm.py`` and ``profile_pipeline_runtime.py``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

import splitgrad
from splitgrad.pipeline.runtime import build_runtime
from splitgrad.pipeline.timeline import TimelineEvent
from splitgrad.pipeline.torch_adapter import splitgrad_pipeline_stage

TORCH_SCHEDULES = ("1F1B", "InterleavedZB", "ZBV")
SPLITGRAD_SCHEDULES = ("1f1b", "zb-h1", "zbv", "v-half", "v-min")
V_SCHEDULES = ("zbv", "v-half", "v-min")  # two stages per rank
DETACH_BUG = "Can't detach views in-place"
REF, REF2 = "reference (1 process)", "reference, both ranks at once"


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
        n_stages = 4 if schedule in V_SCHEDULES else 2
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


def build_variants(cfg: BenchConfig, rank: int, head_to_head: bool = False) -> dict[str, object]:
    """Every variant; ``head_to_head``: only splitgrad's V schedules and PyTorch's zero-bubble schedules (the
    others are not built: no models, stages or runtimes for variants the run does not time)."""
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
        if not head_to_head
        or key.endswith(tuple(f"splitgrad {name}" for name in V_SCHEDULES))
        or ("torch" in key and "ZB" in key)
    }
