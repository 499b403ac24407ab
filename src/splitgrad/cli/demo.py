"""``python -m splitgrad demo``: train a small GPT with pipeline parallelism, 1F1B vs zero-bubble, and compare.

The main job. It trains a character-level GPT (built from splitgrad layers with deferred wgrad) on text this
machine already has — the Python standard library's source — with ``--ranks`` pipeline ranks on
torch.distributed, once per schedule (default ``1f1b`` then ``zb-h1``) from the same initial weights and the
same batches, and prints per schedule: loss, tokens/s, the measured bubble ratio next to the simulated one,
and peak memory per rank. Into ``--out`` it writes each schedule's measured timeline (Perfetto JSON + PNG
Gantt chart) and a loss-curve PNG.

Launch:

* one machine: ``python -m splitgrad demo`` spawns ``--ranks`` local processes (gloo on CPU, NCCL on GPU);
* several machines: start it under ``torchrun`` (one process per pipeline rank), e.g. on each of 2 hosts
  ``torchrun --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint HOST0:29500 -m splitgrad demo``;
  the world size is then the number of pipeline ranks.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import asdict, dataclass
from pathlib import Path

__all__ = ["DemoConfig", "add_parser", "run"]


@dataclass(kw_only=True, slots=True)
class DemoConfig:
    """Knobs of the demo (``--help`` lists them); validated before any process starts."""

    schedules: tuple[str, ...] = ("1f1b", "zb-h1")
    """Schedules to train with, one after the other, from the same initial weights."""
    ranks: int = 2
    """Pipeline ranks (processes). Schedules with two stages per rank (zbv) cut the model into 2 x ranks."""
    microbatches: int = 8
    """Microbatches per step."""
    steps: int = 40
    """Optimizer steps per schedule."""
    batch_size: int = 32
    """Sequences per step (split into ``microbatches``)."""
    seq_len: int = 128
    """Characters per sequence."""
    hidden_size: int = 256
    """Model width."""
    num_layers: int = 4
    """Transformer blocks."""
    num_heads: int = 4
    """Attention heads."""
    lr: float = 1e-3
    """AdamW learning rate."""
    max_chars: int = 400_000
    """Characters of standard-library source to read."""
    threads: int = 1
    """torch threads per rank (ranks share this machine's cores)."""
    timeout: float = 120.0
    """Seconds any rank may wait for a peer before the run fails, naming the peer and the action."""
    seed: int = 0
    """Seed of the initial weights and of the batch order."""
    out: str = "out/demo"
    """Folder for timelines, traces and the loss curve."""

    def __post_init__(self) -> None:
        checks = {
            "ranks": self.ranks >= 1,
            "microbatches": self.microbatches >= 1,
            "steps": self.steps >= 1,
            "batch_size": self.batch_size >= self.microbatches and self.batch_size % self.microbatches == 0,
            "num_layers": self.num_layers >= 1,
            "lr": self.lr > 0,
            "threads": self.threads >= 1,
            "timeout": self.timeout > 0,
            "schedules": len(self.schedules) >= 1,
        }
        bad = [name for name, ok in checks.items() if not ok]
        if bad:
            raise ValueError(
                f"demo: invalid {', '.join(bad)}: "
                + ", ".join(f"{name}={getattr(self, name)!r}" for name in bad)
                + " (batch_size must be a positive multiple of microbatches)"
            )


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="train a small GPT on 2 pipeline ranks, 1f1b vs zero-bubble (the main job)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    defaults = DemoConfig()
    parser.add_argument(
        "--schedules",
        default=",".join(defaults.schedules),
        help="comma-separated names; 'auto' profiles the first step and plans zb-auto from the measured costs",
    )
    for name, help_text in (
        ("ranks", "pipeline ranks (local processes, or the torchrun world size)"),
        ("microbatches", "microbatches per step"),
        ("steps", "optimizer steps per schedule"),
        ("batch-size", "sequences per step"),
        ("seq-len", "characters per sequence"),
        ("hidden-size", "model width"),
        ("num-layers", "transformer blocks"),
        ("num-heads", "attention heads"),
        ("max-chars", "characters of stdlib source to read"),
        ("threads", "torch threads per rank"),
        ("seed", "seed of weights and batches"),
    ):
        parser.add_argument(
            f"--{name}", type=int, default=getattr(defaults, name.replace("-", "_")), help=help_text
        )
    parser.add_argument("--lr", type=float, default=defaults.lr, help="AdamW learning rate")
    parser.add_argument("--timeout", type=float, default=defaults.timeout, help="seconds to wait for a peer")
    parser.add_argument("--out", default=defaults.out, help="output folder")
    parser.set_defaults(func=run)


def config_from_args(args: argparse.Namespace) -> DemoConfig:
    fields = {k: v for k, v in vars(args).items() if k in DemoConfig.__dataclass_fields__}
    fields["schedules"] = tuple(s.strip() for s in args.schedules.split(",") if s.strip())
    return DemoConfig(**fields)


def run(args: argparse.Namespace) -> int:
    """Entry point of ``python -m splitgrad demo`` (spawns local ranks, or joins a torchrun job)."""
    from ._demo_worker import train_all

    cfg = config_from_args(args)
    Path(cfg.out).mkdir(parents=True, exist_ok=True)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return _run_under_torchrun(cfg, train_all)

    import torch

    from ..testing.spawn import spawn

    print(
        f"splitgrad demo: GPT {cfg.num_layers} layers x {cfg.hidden_size}, {cfg.ranks} pipeline ranks "
        f"(local gloo processes, {cfg.threads} thread(s) each), schedules {', '.join(cfg.schedules)}",
        flush=True,
    )
    budget = cfg.timeout * (4 + cfg.steps) * len(cfg.schedules)  # whole run; each wait is bounded separately
    backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= cfg.ranks else "gloo"
    results = spawn(
        train_all, cfg.ranks, asdict(cfg),
        timeout=budget, pg_timeout=cfg.timeout, threads=cfg.threads, backend=backend,
    )  # fmt: skip
    return int(results[0])


def _run_under_torchrun(cfg: DemoConfig, train_all) -> int:
    import datetime

    import torch
    import torch.distributed as dist

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=cfg.timeout))
    try:
        if dist.get_world_size() != cfg.ranks:
            cfg = DemoConfig(**(asdict(cfg) | {"ranks": dist.get_world_size()}))
        torch.set_num_threads(cfg.threads)
        return int(train_all(dist.get_rank(), dist.get_world_size(), asdict(cfg)))
    finally:
        dist.destroy_process_group()
