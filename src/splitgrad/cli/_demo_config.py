"""The demo's knobs (:class:`DemoConfig`), apart from the CLI and the worker so both import it one way."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DemoConfig"]


@dataclass(kw_only=True, slots=True)
class DemoConfig:
    """Knobs of the demo (``--help`` lists them); validated before any process starts."""

    schedules: tuple[str, ...] = ("1f1b", "zb-h1")
    """Schedules to train with, one after the other, from the same initial weights."""
    ranks: int = 2
    """Pipeline ranks (processes). Schedules with two stages per rank (zbv, dualpipev, interleaved-1f1b) cut
    the model into 2 x ranks stages, so they need ``num_layers >= 2 * ranks``."""
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
    """Folder for timelines, traces, the loss curve and ``metrics_<schedule>.jsonl`` (one line per step)."""
    checkpoint_dir: str | None = None
    """Folder of the checkpoints (``<dir>/<schedule>/step_<k>``); None: no checkpoints."""
    checkpoint_every: int = 0
    """Checkpoint every this many steps (and after the last); 0: after the last step only."""
    resume: str | None = None
    """``"latest"``: continue from the newest complete checkpoint under ``checkpoint_dir`` (from step 0 when
    there is none, so the same command also starts the job); or the folder of one checkpoint."""

    def __post_init__(self) -> None:
        checks = {
            "ranks": self.ranks >= 1,
            "microbatches": self.microbatches >= 1,
            "steps": self.steps >= 1,
            # Checked only with a usable divisor: microbatches=0 is reported above, not as a ZeroDivisionError.
            "batch_size": self.microbatches < 1
            or (self.batch_size >= self.microbatches and self.batch_size % self.microbatches == 0),
            "seq_len": self.seq_len >= 1,
            "hidden_size": self.hidden_size >= 1,
            "num_layers": self.num_layers >= 1,
            "num_heads": self.num_heads >= 1,
            "lr": self.lr > 0,
            "max_chars": self.max_chars >= 1,
            "threads": self.threads >= 1,
            "timeout": self.timeout > 0,
            "seed": self.seed >= 0,
            "checkpoint_every": self.checkpoint_every >= 0,
            "schedules": len(self.schedules) >= 1,
        }
        bad = [name for name, ok in checks.items() if not ok]
        if bad:
            hint = " (batch_size must be a positive multiple of microbatches)" if "batch_size" in bad else ""
            raise ValueError(
                "demo: invalid " + ", ".join(f"{name}={getattr(self, name)!r}" for name in bad) + hint
            )
