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
import multiprocessing
import os
import signal
import sys
import threading
import time
from dataclasses import asdict
from typing import Any

from ._demo_checks import (
    check_config,
    check_out_dir,
    non_negative_int,
    positive_float,
    positive_int,
    schedule_list,
    stages_for,
    stages_per_rank,
)
from ._demo_config import DemoConfig

__all__ = ["DemoConfig", "add_parser", "check_config", "run", "stages_for", "stages_per_rank"]


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The module docstring as written, and every option's default."""


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="train a small GPT on 2 pipeline ranks, 1f1b vs zero-bubble (the main job)",
        description=__doc__,
        formatter_class=_HelpFormatter,
    )
    defaults = DemoConfig()
    parser.add_argument(
        "--schedules",
        type=schedule_list,
        default=",".join(defaults.schedules),  # a string default goes through type= too
        help="comma-separated schedule names, trained one after the other; 'auto' profiles the first "
        "steps and plans zb-auto from the measured costs",
    )
    for name, kind, help_text in (
        (
            "ranks",
            positive_int,
            "pipeline ranks (local processes, or the torchrun world size); zbv, "
            "dualpipev and interleaved-1f1b put 2 stages on each",
        ),
        ("microbatches", positive_int, "microbatches per step"),
        ("steps", positive_int, "optimizer steps per schedule"),
        ("batch-size", positive_int, "sequences per step (a multiple of --microbatches)"),
        ("seq-len", positive_int, "characters per sequence"),
        ("hidden-size", positive_int, "model width"),
        ("num-layers", positive_int, "transformer blocks (at least one per pipeline stage)"),
        ("num-heads", positive_int, "attention heads (must divide --hidden-size)"),
        ("max-chars", positive_int, "characters of stdlib source to read"),
        ("threads", positive_int, "torch threads per rank"),
        ("seed", non_negative_int, "seed of weights and batches"),
    ):
        parser.add_argument(
            f"--{name}", type=kind, default=getattr(defaults, name.replace("-", "_")), help=help_text
        )
    parser.add_argument("--lr", type=positive_float, default=defaults.lr, help="AdamW learning rate")
    parser.add_argument(
        "--timeout", type=positive_float, default=defaults.timeout, help="seconds to wait for a peer"
    )
    parser.add_argument("--out", default=defaults.out, help="output folder")
    parser.add_argument(
        "--checkpoint-dir",
        default=None,
        help="save checkpoints under this folder (<dir>/<schedule>/step_<k>, torch.distributed.checkpoint)",
    )
    parser.add_argument(
        "--checkpoint-every",
        type=non_negative_int,
        default=defaults.checkpoint_every,
        help="checkpoint every N steps and after the last one (0: after the last one only)",
    )
    parser.add_argument(
        "--resume",
        nargs="?",
        const="latest",
        default=None,
        metavar="PATH",
        help="continue from the newest complete checkpoint under --checkpoint-dir (from step 0 when there is "
        "none, so the same command restarts a job), or from the checkpoint folder PATH",
    )
    parser.add_argument(
        "--moe", action="store_true", help="train an MoE GPT with expert parallelism instead (see --ep)"
    )
    parser.add_argument("--ep", type=positive_int, default=2, help="expert-parallel ranks (with --moe)")
    parser.set_defaults(func=run, usage_error=parser.error)


def config_from_args(args: argparse.Namespace) -> DemoConfig:
    fields = {k: v for k, v in vars(args).items() if k in DemoConfig.__dataclass_fields__}
    if isinstance(args.schedules, str):  # a Namespace built by hand rather than by the parser
        fields["schedules"] = tuple(s.strip() for s in args.schedules.split(",") if s.strip())
    return DemoConfig(**fields)


def run(args: argparse.Namespace) -> int:
    """Entry point of ``python -m splitgrad demo`` (spawns local ranks, or joins a torchrun job).

    Every user mistake is reported before any rank starts, as one ``error:`` line with exit code 2; Ctrl-C
    stops the ranks and exits with 130.
    """
    if getattr(args, "moe", False):
        from .moe_demo import run_moe  # expert-parallel variant: its own module

        return run_moe(args)
    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    try:
        cfg = config_from_args(args)
        if under_torchrun and cfg.ranks != int(os.environ["WORLD_SIZE"]):
            cfg = DemoConfig(**(asdict(cfg) | {"ranks": int(os.environ["WORLD_SIZE"])}))
        check_config(cfg)
        check_out_dir(cfg.out)
    except ValueError as exc:
        return _usage_error(args, str(exc))
    try:
        return _run_under_torchrun(cfg) if under_torchrun else _spawn_local(cfg)
    except KeyboardInterrupt:
        # _spawn_local has killed the local ranks; under torchrun the launcher stops the others.
        print("\nsplitgrad demo: interrupted, ranks stopped", file=sys.stderr, flush=True)
        return 130


def _usage_error(args: argparse.Namespace, message: str) -> int:
    error = getattr(args, "usage_error", None)
    if error is not None:
        error(message)  # argparse's: usage, then "splitgrad demo: error: ...", exit 2
    print(f"splitgrad demo: error: {message}", file=sys.stderr)
    return 2


def _spawn_local(cfg: DemoConfig) -> int:
    import torch

    from ..distributed.launch import spawn

    print(
        f"splitgrad demo: GPT {cfg.num_layers} layers x {cfg.hidden_size}, {cfg.ranks} pipeline ranks "
        f"(local gloo processes, {cfg.threads} thread(s) each), schedules {', '.join(cfg.schedules)}",
        flush=True,
    )
    budget = cfg.timeout * (4 + cfg.steps) * len(cfg.schedules)  # whole run; each wait is bounded separately
    backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= cfg.ranks else "gloo"
    outcome: dict[str, Any] = {}

    def launch() -> None:
        try:
            outcome["results"] = spawn(
                _local_rank, cfg.ranks, asdict(cfg),
                timeout=budget, pg_timeout=cfg.timeout, threads=cfg.threads, backend=backend,
            )  # fmt: skip
        except BaseException as exc:  # handed to the main thread
            outcome["error"] = exc

    # Ctrl-C in a terminal signals every process of the group. The ranks must ignore it from their first
    # instruction (an interrupted import prints a traceback), so they are started while SIGINT is ignored
    # (a disposition children inherit), on a thread; the main thread handles Ctrl-C and kills them.
    launcher = threading.Thread(target=launch, name="splitgrad-demo-spawn", daemon=True)
    _start_with_sigint_ignored(launcher, cfg.ranks)
    try:
        while launcher.is_alive():
            launcher.join(0.1)
    except KeyboardInterrupt:
        for child in multiprocessing.active_children():
            if child.name.startswith("splitgrad-rank"):
                child.kill()
        launcher.join(timeout=30)  # spawn() notices the dead ranks and removes its files
        raise
    if "error" in outcome:
        raise outcome["error"]
    return int(outcome["results"][0])


def _start_with_sigint_ignored(launcher: threading.Thread, ranks: int) -> None:
    """Start ``launcher`` and return once it has started ``ranks`` processes (or ended), SIGINT ignored."""
    if threading.current_thread() is not threading.main_thread():  # only the main thread may set handlers
        launcher.start()
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        launcher.start()
        deadline = time.monotonic() + 60.0
        while launcher.is_alive() and time.monotonic() < deadline:
            started = [c for c in multiprocessing.active_children() if c.name.startswith("splitgrad-rank")]
            if len(started) >= ranks:
                break
            time.sleep(0.01)
    finally:
        signal.signal(signal.SIGINT, previous)


def _local_rank(rank: int, world_size: int, cfg_fields: dict[str, Any]) -> int:
    """A locally spawned rank (SIGINT stays ignored even if it started outside the launch window above)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from ._demo_worker import train_all

    return train_all(rank, world_size, cfg_fields)


def _run_under_torchrun(cfg: DemoConfig) -> int:
    import datetime

    import torch
    import torch.distributed as dist

    from ._demo_worker import train_all

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=cfg.timeout))
    try:
        torch.set_num_threads(cfg.threads)
        return int(train_all(dist.get_rank(), dist.get_world_size(), asdict(cfg)))
    finally:
        dist.destroy_process_group()
