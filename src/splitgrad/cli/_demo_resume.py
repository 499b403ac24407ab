"""What makes a demo run survive: its checkpoints, where it resumes, and the per-step metrics file.

* :func:`open_checkpoints`: a :class:`~splitgrad.pipeline.checkpoint.PipelineCheckpointer` under
  ``<checkpoint_dir>/<schedule>`` and, with ``--resume``, the restored step and data position (the batch
  generator's state, saved with every checkpoint);
* :class:`MetricsLog`: ``metrics_<schedule>.jsonl``, one JSON line per step, written by rank 0 and flushed per
  line. A resumed run keeps the lines up to its checkpoint and writes the rest, so a job restarted after a
  crash ends with each step exactly once, its loss bitwise the uninterrupted run's.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..pipeline.checkpoint import PipelineCheckpointer
from ._demo_config import DemoConfig

__all__ = ["MetricsLog", "data_state", "open_checkpoints"]

logger = logging.getLogger(__name__)


def open_checkpoints(
    cfg: DemoConfig,
    schedule: str,
    runtime: Any,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    rank: int,
) -> tuple[PipelineCheckpointer | None, int, torch.Generator]:
    """``(checkpointer or None, steps already done, batch generator at that position)`` (every rank)."""
    generator = torch.Generator().manual_seed(cfg.seed)
    if cfg.checkpoint_dir is None and cfg.resume is None:
        return None, 0, generator
    explicit = cfg.resume not in (None, "latest")
    root = Path(cfg.checkpoint_dir) / schedule if cfg.checkpoint_dir is not None else Path(cfg.resume).parent
    checkpointer = PipelineCheckpointer(root, runtime, model, optimizer, timeout=cfg.timeout)
    if cfg.resume is None:
        return checkpointer, 0, generator
    try:
        restored = checkpointer.load(cfg.resume if explicit else None)
    except FileNotFoundError:
        if explicit:
            raise
        if rank == 0:
            print(f"  [{schedule}] no complete checkpoint under {root}: starting at step 1", flush=True)
        return checkpointer, 0, generator
    data = restored.extra["data"]
    if data["batches"] != restored.step:
        raise RuntimeError(
            f"{restored.path}: data position {data['batches']} batches for step {restored.step}"
        )
    generator.set_state(data["generator"])
    if rank == 0:
        rng = "restored" if restored.rng_restored else "not restored (another rank layout)"
        print(
            f"  [{schedule}] resumed from {restored.path} after step {restored.step} (saved under "
            f"{restored.saved_schedule}; data position {data['batches']} batches; generators {rng})",
            flush=True,
        )
    return checkpointer, restored.step, generator


def data_state(generator: torch.Generator, batches: int) -> dict[str, Any]:
    """The data position a checkpoint carries: batches drawn so far and the generator's state."""
    return {"batches": batches, "generator": generator.get_state()}


class MetricsLog:
    """``metrics_<schedule>.jsonl`` under ``out`` (rank 0 writes; other ranks hold a no-op log).

    Args:
        out: the output folder.
        schedule: the schedule trained.
        resumed_at: steps already done (their lines are kept, later ones dropped); 0: a new file.
        enabled: whether this rank writes.
    """

    def __init__(self, out: str | Path, schedule: str, *, resumed_at: int, enabled: bool) -> None:
        self.path = Path(out) / f"metrics_{schedule}.jsonl"
        self.enabled = enabled
        self.kept: list[dict[str, Any]] = []
        if not enabled:
            return
        if resumed_at and self.path.exists():
            for line in self.path.read_text().splitlines():
                try:
                    record = json.loads(line)
                except ValueError:  # a line cut short when the job died
                    continue
                if record.get("step", 0) <= resumed_at:
                    self.kept.append(record)
        with open(self.path, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in self.kept)

    def write(self, **record: Any) -> None:
        """Append one step's line (``step``, ``loss``, ``step_time_s``, ``tokens_per_s``, ...) and flush it."""
        if not self.enabled:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
