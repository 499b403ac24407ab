"""One rank of ``python -m splitgrad demo``: train the GPT once per schedule and report what was measured.

Every rank builds the same model from the same seed and keeps only its own stages (the runtime does that);
rank 0 prints progress and the summary and writes the pictures. Runs inside an initialised process group.
"""

from __future__ import annotations

import logging
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..core import guard_optimizer
from ..models import GPT, GPTConfig, lm_loss, load_char_corpus, split_into_stages
from ..pipeline import build_runtime
from ._demo_checks import stages_for
from ._demo_config import DemoConfig
from ._demo_resume import MetricsLog, data_state, open_checkpoints

__all__ = ["stages_for", "train_all"]

logger = logging.getLogger(__name__)


def _max_rss_mib() -> float:
    # ru_maxrss is KiB on Linux and bytes on macOS.
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (2**20 if sys.platform == "darwin" else 2**10)


def _train_one(cfg: DemoConfig, schedule: str, corpus, rank: int, device: torch.device) -> dict[str, Any]:
    torch.manual_seed(cfg.seed)
    n_stages = stages_for(schedule, cfg.ranks, cfg.microbatches)
    model_cfg = GPTConfig(
        vocab_size=corpus.tokenizer.vocab_size,
        seq_len=cfg.seq_len,
        hidden_size=cfg.hidden_size,
        num_layers=cfg.num_layers,
        num_heads=cfg.num_heads,
        delay_wgrad_compute=True,
    )
    model = GPT(model_cfg, device=device)
    runtime = build_runtime(
        split_into_stages(model, n_stages),
        schedule,
        loss_fn=lm_loss,
        n_microbatches=cfg.microbatches,
        timeout=cfg.timeout,
        track_memory=True,
        device=device,
    )
    optimizer = torch.optim.AdamW(runtime.parameters(), lr=cfg.lr)
    for stage in runtime.stages.values():
        guard_optimizer(optimizer, stage)
    checkpointer, done, generator = open_checkpoints(cfg, schedule, runtime, model, optimizer, rank)
    metrics = MetricsLog(cfg.out, schedule, resumed_at=done, enabled=rank == 0)
    losses = [r["loss"] for r in metrics.kept]
    durations, peak_act = [], 0
    tokens_per_step = cfg.batch_size * cfg.seq_len
    result = None
    for step in range(done + 1, cfg.steps + 1):
        inputs, targets = corpus.train.get_batch(cfg.batch_size, generator=generator)
        start = time.perf_counter()
        runtime.zero_grad()
        result = runtime.step(inputs.to(device), targets.to(device))
        optimizer.step()
        durations.append(time.perf_counter() - start)
        losses.append(float(result.loss))
        peak_act = max(peak_act, result.peak_activation_bytes or 0)
        record = {
            "step": step, "loss": losses[-1], "step_time_s": durations[-1],
            "tokens_per_s": tokens_per_step / durations[-1],
        }  # fmt: skip
        if _checkpoint_due(cfg, step):
            saved = checkpointer.save(step, extra={"data": data_state(generator, step)}, async_save=True)
            record["checkpoint_s"] = saved.blocking_s
        metrics.write(**record)
        if rank == 0 and (step % 5 == 0 or step == cfg.steps or step == done + 1):
            print(
                f"  [{schedule}] step {step:>3}/{cfg.steps}  loss {losses[-1]:.4f}  "
                f"{tokens_per_step / durations[-1]:,.0f} tokens/s",
                flush=True,
            )
    if checkpointer is not None:
        checkpointer.close()  # waits for the last write and publishes it
    out = Path(cfg.out)
    # The last step's timeline (none when the run resumed after its last step).
    report = None if result is None else runtime.timeline_report(result, out / f"timeline_{schedule}")
    # A tensor collective, not all_gather_object: that one needs numpy, which a plain `pip install` lacks.
    mine = torch.tensor([peak_act / 2**20, _max_rss_mib()], dtype=torch.float64, device=device)
    gathered = [torch.empty_like(mine) for _ in range(cfg.ranks)]
    dist.all_gather(gathered, mine)
    per_rank = [{"activation_mib": float(t[0]), "max_rss_mib": float(t[1])} for t in gathered]
    # Release the process groups now, not whenever the runtime is collected: the caller destroys them next.
    runtime.close()
    # Steady state: skip the first steps (allocator warm-up, first-touch of buffers).
    steady = durations[min(3, len(durations) - 1) :] or [float("nan")]
    return {
        "schedule": schedule,
        "n_stages": n_stages,
        "losses": losses,
        "step_s": statistics.median(steady),
        "tokens_per_s": tokens_per_step / statistics.median(steady),
        "report": report,
        "per_rank": per_rank,
    }


def _checkpoint_due(cfg: DemoConfig, step: int) -> bool:
    """Whether the run saves after ``step`` (only with ``--checkpoint-dir``: ``--resume PATH`` alone saves nothing)."""
    if cfg.checkpoint_dir is None:
        return False
    return step == cfg.steps or bool(cfg.checkpoint_every and step % cfg.checkpoint_every == 0)


def train_all(rank: int, world_size: int, cfg_fields: dict[str, Any]) -> int:
    """Train once per schedule; rank 0 prints the summary and writes the loss curve. Returns an exit code."""
    cfg = DemoConfig(**cfg_fields)
    device = (
        torch.device(f"cuda:{torch.cuda.current_device()}")
        if torch.cuda.is_available()
        else torch.device("cpu")
    )
    corpus = load_char_corpus(cfg.seq_len, max_chars=cfg.max_chars)
    if rank == 0:
        print(
            f"corpus: {len(corpus.train) + len(corpus.val):,} windows of {cfg.seq_len} chars from the Python "
            f"standard library, vocabulary {corpus.tokenizer.vocab_size}",
            flush=True,
        )
    runs = []
    for schedule in cfg.schedules:
        if rank == 0:
            print(f"training with {schedule} ...", flush=True)
        runs.append(_train_one(cfg, schedule, corpus, rank, device))
    if rank != 0:
        return 0
    _print_summary(cfg, runs)
    curve = _save_loss_curve(runs, Path(cfg.out) / "loss_curve.png")
    written = sorted(str(p) for p in Path(cfg.out).iterdir())
    print(f"\nwrote {len(written)} files to {cfg.out}/: " + ", ".join(Path(p).name for p in written))
    if curve is None:
        print("(matplotlib is not installed: no PNGs; `pip install splitgrad[plot]`)")
    return 0


def _print_summary(cfg: DemoConfig, runs: list[dict[str, Any]]) -> None:
    print(f"\nsummary ({cfg.ranks} ranks, {cfg.microbatches} microbatches, {cfg.steps} steps per schedule)\n")
    print("| schedule | stages | final loss | median step (s) | tokens/s | peak activations per rank (MiB) "
          "| max RSS per rank (MiB) |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---|---|")
    for r in runs:
        act = " / ".join(f"{p['activation_mib']:.1f}" for p in r["per_rank"])
        rss = " / ".join(f"{p['max_rss_mib']:.0f}" for p in r["per_rank"])
        final = f"{r['losses'][-1]:.4f}" if r["losses"] else "-"
        print(
            f"| {r['schedule']} | {r['n_stages']} | {final} | {r['step_s']:.3f} | "
            f"{r['tokens_per_s']:,.0f} | {act} | {rss} |"
        )
    print()
    for r in runs:
        if r["report"]:
            print(r["report"])
    if len(runs) > 1 and all(r["losses"] for r in runs):
        base = runs[0]["losses"]
        for r in runs[1:]:
            diff = max(abs(a - b) for a, b in zip(base, r["losses"]))
            print(
                f"max |loss difference| {runs[0]['schedule']} vs {r['schedule']} over {len(base)} steps: "
                f"{diff:.2e} (same weights, same batches: the schedule changes when work runs, not what)"
            )


def _save_loss_curve(runs: list[dict[str, Any]], path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    for r in runs:
        style = "-" if r is runs[0] else "--"
        ax.plot(
            range(1, len(r["losses"]) + 1),
            r["losses"],
            style,
            label=f"{r['schedule']} ({r['tokens_per_s']:,.0f} tok/s)",
        )
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (cross-entropy, nats/char)")
    ax.set_title("splitgrad demo: char-level GPT on Python stdlib source")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
