"""Faults a long run meets: a rank killed mid-step, a checkpoint writer killed mid-write, partial folders.

Why: a job of weeks loses ranks. The survivors of a SIGKILL must fail by themselves within the runtime's
timeout, naming the dead rank and what they waited for (not hang until someone notices), and leave no process
behind; a checkpoint that was being written when its writer died must never be loaded. The processes here are
real ones (``python -m tests.checkpoint.fault_worker``), so their exit codes and their children are observed as
a launcher would observe them.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from splitgrad.pipeline.checkpoint import (
    IncompleteCheckpointError,
    checkpoint_path,
    latest_checkpoint,
    verify_checkpoint,
)
from tests.checkpoint.fault_worker import KILL_RANK, KILL_STEP, STEPS, TIMEOUT
from tests.helpers import run_torchrun

ROOT = Path(__file__).resolve().parents[2]


def _env(tag: str, **extra: str) -> dict[str, str]:
    path = os.pathsep.join([str(ROOT / "src"), str(ROOT)])
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "SPLITGRAD_FAULT_TAG": tag, **extra}


def tagged_processes(tag: str) -> list[int]:
    """Pids of live processes started with ``SPLITGRAD_FAULT_TAG=tag`` in their environment (orphans)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if f"SPLITGRAD_FAULT_TAG={tag}".encode() in environ.split(b"\0") and state != "Z":
            found.append(int(entry.name))
    return found


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.distributed
def test_sigkill_mid_step_fails_every_other_rank_in_time_naming_the_dead_rank():
    tag, port = uuid.uuid4().hex, str(_free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.checkpoint.fault_worker", "kill"],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=_env(tag, RANK=str(r), WORLD_SIZE="3", MASTER_ADDR="127.0.0.1", MASTER_PORT=port),
        )
        for r in range(3)
    ]
    try:
        procs[KILL_RANK].wait(timeout=300)  # start-up on a loaded machine, then steps 1 and 2
        killed_at = time.monotonic()
        exits = {}
        for rank, proc in enumerate(procs):
            proc.wait(timeout=TIMEOUT + 60)
            exits[rank] = time.monotonic() - killed_at
        outputs = {rank: proc.communicate() for rank, proc in enumerate(procs)}
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    assert procs[KILL_RANK].returncode == -signal.SIGKILL, outputs[KILL_RANK]
    assert f"SIGKILL at action {KILL_RANK}F0 of step {KILL_STEP}" in outputs[KILL_RANK][0]
    for rank in (0, 2):
        out, err = outputs[rank]
        assert procs[rank].returncode not in (0, None), (rank, out, err)
        assert f"rank {rank}: step {KILL_STEP - 1} done" in out and f"step {KILL_STEP} done" not in out
        assert exits[rank] < TIMEOUT + 30, f"rank {rank} took {exits[rank]:.1f} s to fail after the kill"
        # The runtime's error: this pipeline rank, the dead peer, and the action whose message it waited for.
        # torch prefixes an uncaught exception's lines with "[rankN]: " once the process group exists.
        lines = [re.sub(r"^\[rank\d+\]: ", "", line) for line in err.splitlines()]
        error = [line for line in lines if line.startswith("RuntimeError: pipeline rank")]
        assert error, err[-3000:]
        assert f"pipeline rank {rank}" in error[-1] and f"from rank {KILL_RANK}" in error[-1], error[-1]
        assert re.search(r"action \d+(F|B|BW|W)\d+", error[-1]), error[-1]
    assert tagged_processes(tag) == [], "processes of the job outlived it"


@pytest.mark.distributed
def test_a_writer_killed_mid_write_leaves_nothing_loadable(tmp_path):
    tag = uuid.uuid4().hex
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.checkpoint.fault_worker", "write", str(tmp_path)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(tag),
    )  # fmt: skip
    try:
        assert proc.stdout.readline().strip() == "WRITING", proc.stderr.read()
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    unfinished = [p for p in tmp_path.iterdir() if p.name.startswith("step_00000002")]
    assert len(unfinished) == 1 and ".tmp-" in unfinished[0].name, sorted(tmp_path.iterdir())
    assert latest_checkpoint(tmp_path) == checkpoint_path(tmp_path, 1)  # the last complete one
    with pytest.raises(IncompleteCheckpointError, match="being written"):
        verify_checkpoint(unfinished[0])
    assert tagged_processes(tag) == []


def _published(tmp_path: Path) -> Path:
    """A complete-looking checkpoint folder with a marker, made by hand."""
    path = checkpoint_path(tmp_path, 4)
    path.mkdir()
    (path / "__0_0.distcp").write_bytes(b"x" * 100)
    (path / ".metadata").write_bytes(b"m" * 10)
    files = {"__0_0.distcp": 100, ".metadata": 10}
    (path / "splitgrad_checkpoint.json").write_text(json.dumps({"format": 1, "files": files, "step": 4}))
    return path


def test_only_complete_checkpoints_are_visible(tmp_path, caplog):
    good = _published(tmp_path)
    assert latest_checkpoint(tmp_path) == good
    # A newer folder without a marker (copied by hand, or a publish interrupted before the marker) is skipped.
    unmarked = checkpoint_path(tmp_path, 6)
    unmarked.mkdir()
    (unmarked / ".metadata").write_bytes(b"m")
    assert latest_checkpoint(tmp_path) == good
    assert "was never published complete" in caplog.text
    with pytest.raises(IncompleteCheckpointError, match=r"no splitgrad_checkpoint\.json"):
        verify_checkpoint(unmarked)
    # A file cut short after publishing is named.
    (good / "__0_0.distcp").write_bytes(b"x" * 60)
    with pytest.raises(
        IncompleteCheckpointError, match=r"__0_0\.distcp is 60 bytes, its marker recorded 100"
    ):
        verify_checkpoint(good)
    assert latest_checkpoint(tmp_path) is None
    with pytest.raises(FileNotFoundError):
        verify_checkpoint(tmp_path / "step_00000009")


@pytest.mark.distributed
def test_torchrun_restarts_a_killed_job_from_the_last_complete_checkpoint(tmp_path):
    tag = uuid.uuid4().hex
    proc = run_torchrun(
        [str(ROOT / "tests" / "checkpoint" / "fault_worker.py"), "restart", str(tmp_path)],
        ranks=2, cwd=ROOT, torchrun_args=["--max-restarts", "1", "--monitor-interval", "0.5"], env=_env(tag),
        timeout=400,
    )  # fmt: skip
    out = proc.stdout
    assert proc.returncode == 0, (out, proc.stderr[-3000:])
    assert f"attempt 0 rank {KILL_RANK}: SIGKILL in step {KILL_STEP}" in out, out
    for rank in (0, 1):
        # The first attempt finished steps before the kill; none after it.
        first = [int(s) for s in re.findall(rf"attempt 0 rank {rank}: step (\d+) done", out)]
        assert first == list(range(1, KILL_STEP)), out
        # torchrun restarted the job by itself; it resumed from the last complete checkpoint and finished.
        resumed = checkpoint_path(tmp_path, KILL_STEP - 1)
        assert f"attempt 1 rank {rank}: resumed from {resumed} after step {KILL_STEP - 1}" in out, out
        second = [int(s) for s in re.findall(rf"attempt 1 rank {rank}: step (\d+) done", out)]
        assert second == list(range(KILL_STEP, STEPS + 1)), out
    assert latest_checkpoint(tmp_path) == checkpoint_path(tmp_path, STEPS)
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]  # the restart removed the leftovers
    assert tagged_processes(tag) == []
