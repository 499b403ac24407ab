"""Checks of ``python -m splitgrad demo``'s arguments, all made in the parent before any rank starts.

``argparse`` ``type=`` functions reject a malformed value on its own (``--ranks 0``); :func:`check_config`
rejects combinations (heads not dividing the width, more stages than layers, a schedule that cannot run
the requested counts). Either way the user gets one ``error:`` line and exit code 2, never a traceback
from inside a spawned rank.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ._demo_config import DemoConfig

__all__ = [
    "check_config",
    "check_out_dir",
    "non_negative_int",
    "positive_float",
    "positive_int",
    "schedule_list",
    "stages_for",
    "stages_per_rank",
]


def stages_per_rank(schedule: str) -> int:
    """Model stages ``schedule`` places on each rank (2 for zbv, dualpipev, interleaved-1f1b; else 1).

    Read from the schedule itself (a 2-stage probe), so a new family needs no entry here.

    Raises:
        ValueError: unknown schedule name.
    """
    from ..pipeline import build_schedule

    if schedule == "auto":  # profile-guided zb-auto (planned at run time): one stage per rank
        return 1
    probe = build_schedule(schedule, 2, 2)
    return probe.n_stages // probe.n_ranks


def stages_for(schedule: str, ranks: int, microbatches: int) -> int:
    """Total model stages that put ``schedule`` on ``ranks`` ranks (``ranks x stages_per_rank``).

    Raises:
        ValueError: unknown schedule, or a stage count / microbatch count the schedule cannot run (e.g.
            dualpipev needs ``microbatches >= stages``); the message names the schedule and the counts.
    """
    from ..pipeline import build_schedule

    n_stages = ranks * stages_per_rank(schedule)
    try:
        build_schedule("zb-auto" if schedule == "auto" else schedule, n_stages, microbatches)
    except ValueError as exc:
        raise ValueError(
            f"schedule {schedule} on {ranks} rank(s) ({n_stages} stages) with {microbatches} microbatches: {exc}"
        ) from None
    return n_stages


def check_config(cfg: DemoConfig) -> None:
    """Every check that can fail before a rank starts: schedules, stage counts, model shape, corpus size.

    Raises:
        ValueError: a one-line message naming the offending option(s) and value(s).
    """
    from ..models import GPTConfig

    for schedule in cfg.schedules:
        n_stages = stages_for(schedule, cfg.ranks, cfg.microbatches)
        if n_stages > cfg.num_layers:
            raise ValueError(
                f"schedule {schedule} on {cfg.ranks} rank(s) needs {n_stages} stages of at least one "
                f"transformer block each, but --num-layers is {cfg.num_layers}; use --num-layers >= {n_stages} "
                "or fewer --ranks"
            )
    # The vocabulary is only known once the corpus is read: any positive size checks the rest of the shape.
    GPTConfig(
        vocab_size=1,
        seq_len=cfg.seq_len,
        hidden_size=cfg.hidden_size,
        num_layers=cfg.num_layers,
        num_heads=cfg.num_heads,
    )
    _check_checkpoint_options(cfg)
    held_out = cfg.max_chars - int(cfg.max_chars * 0.9)  # load_char_corpus keeps a 10 % validation tail
    if held_out <= cfg.seq_len:
        raise ValueError(
            f"--max-chars {cfg.max_chars} is too small for --seq-len {cfg.seq_len} "
            f"(the 10 % validation tail must be longer than a sequence): use --max-chars > {10 * (cfg.seq_len + 1)}"
        )


def _check_checkpoint_options(cfg: DemoConfig) -> None:
    if cfg.checkpoint_every and cfg.checkpoint_dir is None:
        raise ValueError(f"--checkpoint-every {cfg.checkpoint_every} needs --checkpoint-dir")
    if cfg.resume == "latest" and cfg.checkpoint_dir is None:
        raise ValueError("--resume without a PATH resumes from --checkpoint-dir: give one, or --resume PATH")
    if cfg.resume not in (None, "latest"):
        if len(cfg.schedules) != 1:
            raise ValueError(
                f"--resume {cfg.resume} is one checkpoint: train one schedule with it, got --schedules "
                f"{','.join(cfg.schedules)}"
            )
        if not Path(cfg.resume).is_dir():
            raise ValueError(f"--resume {cfg.resume}: no such checkpoint folder")
    if (cfg.checkpoint_dir is not None or cfg.resume is not None) and cfg.ranks > 1:
        try:
            import numpy  # noqa: F401
        except ImportError:
            raise ValueError(
                "checkpoints need numpy on several ranks (torch.distributed.checkpoint's object collectives "
                "use it): pip install numpy"
            ) from None


def check_out_dir(out: str) -> None:
    """Create ``--out`` (and parents); ``ValueError`` unless it is then a writable folder."""
    path = Path(out)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"--out {out}: cannot create the folder ({exc.strerror or exc})") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"--out {out}: the folder is not writable")


def positive_int(text: str) -> int:
    """``type=`` of a count option: an int >= 1."""
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text}")
    return value


def non_negative_int(text: str) -> int:
    """``type=`` of ``--seed``: an int >= 0."""
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text}")
    return value


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None


def positive_float(text: str) -> float:
    """``type=`` of ``--lr``/``--timeout``: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def schedule_list(text: str) -> tuple[str, ...]:
    """``type=`` of ``--schedules``: comma-separated known schedule names."""
    from ..pipeline.schedules import schedule_names

    names = tuple(s.strip() for s in text.split(",") if s.strip())
    if not names:
        raise argparse.ArgumentTypeError(f"needs at least one schedule name, got {text!r}")
    for name in names:
        try:
            stages_per_rank(name)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"unknown schedule {name!r}; choose from {', '.join(schedule_names())}"
            ) from None
    return names
