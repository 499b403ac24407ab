"""The main job stopped and restarted: ``--checkpoint-dir``, ``--checkpoint-every``, ``--resume`` and the metrics file.

Why: a run of weeks is a sequence of jobs. A job restarted with the same command must continue where the last
complete checkpoint left off, say so, and end with a ``metrics_<schedule>.jsonl`` whose lines for the steps
after the checkpoint are the uninterrupted run's, bitwise on loss (same schedule, same layout: the same
operations on the same operands, the batch generator's state restored from the checkpoint).
"""

from __future__ import annotations

import json
import shutil

import pytest

from splitgrad.__main__ import main
from splitgrad.cli.demo import DemoConfig
from splitgrad.pipeline.checkpoint import checkpoint_path, list_checkpoints

TINY = [
    "demo", "--schedules", "1f1b", "--hidden-size", "32", "--num-layers", "2", "--num-heads", "2",
    "--seq-len", "16", "--batch-size", "4", "--microbatches", "2", "--max-chars", "20000", "--timeout", "60",
]  # fmt: skip


def _lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.distributed
def test_a_restarted_demo_resumes_from_the_latest_checkpoint_bitwise(tmp_path, capfd):
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    command = [
        *TINY,
        "--steps",
        "4",
        "--out",
        str(out),
        "--checkpoint-dir",
        str(ckpt),
        "--checkpoint-every",
        "2",
    ]
    assert main(command) == 0  # the uninterrupted run, checkpointed after steps 2 and 4
    expected = _lines(out / "metrics_1f1b.jsonl")
    assert [n for n, _ in list_checkpoints(ckpt / "1f1b")] == [4, 2]
    # As if the job had died during step 4: its checkpoint never published, its metrics line half-written.
    shutil.rmtree(checkpoint_path(ckpt / "1f1b", 4))
    with open(out / "metrics_1f1b.jsonl", "a") as f:
        f.write('{"step": 5, "lo')
    capfd.readouterr()
    assert main([*command, "--resume"]) == 0  # the same command restarts the job
    text = capfd.readouterr().out
    assert f"resumed from {checkpoint_path(ckpt / '1f1b', 2)} after step 2" in text, text

    got = _lines(out / "metrics_1f1b.jsonl")
    assert [r["step"] for r in expected] == [1, 2, 3, 4]
    assert [r["step"] for r in got] == [1, 2, 3, 4]  # each step once: lines up to the checkpoint are kept
    for record in got:
        assert {"step", "loss", "step_time_s", "tokens_per_s"} <= record.keys()
        assert record["step_time_s"] > 0 and record["tokens_per_s"] > 0
    # Bitwise (JSON keeps every digit of a float); steps 3 and 4 were computed again after the restore.
    assert [r["loss"] for r in got] == [r["loss"] for r in expected]
    # Not trivially equal: the model learns, so the steps' losses differ from one another.
    assert len({r["loss"] for r in expected}) == 4
    assert [n for n, _ in list_checkpoints(ckpt / "1f1b")] == [4, 2]  # step 4 saved again


def test_checkpoint_options_are_checked(tmp_path):
    from splitgrad.cli._demo_checks import check_config

    with pytest.raises(ValueError, match="--checkpoint-every 2 needs --checkpoint-dir"):
        check_config(DemoConfig(checkpoint_every=2))
    with pytest.raises(ValueError, match="--resume without a PATH"):
        check_config(DemoConfig(resume="latest"))
    with pytest.raises(ValueError, match="no such checkpoint folder"):
        check_config(DemoConfig(schedules=("1f1b",), resume=str(tmp_path / "nope")))
    with pytest.raises(ValueError, match="train one schedule with it"):
        check_config(DemoConfig(resume=str(tmp_path)))
    with pytest.raises(ValueError, match="checkpoint_every"):
        DemoConfig(checkpoint_every=-1)
