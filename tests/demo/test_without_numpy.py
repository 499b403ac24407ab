"""The main job runs where `pip install splitgrad` put only torch: no numpy, no matplotlib.

Why: torch does not require numpy, but its `*_object` collectives call `Tensor.numpy()`, so the demo used to
crash with "Numpy is not available" right after a plain `pip install .`. The test hides numpy from a fresh
interpreter (and from the ranks it spawns) with a stub package that raises ModuleNotFoundError, as a missing package does.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import splitgrad

_SRC = str(Path(splitgrad.__file__).resolve().parents[1])


def _run_without_numpy(tmp_path: Path, args: list[str]) -> subprocess.CompletedProcess[str]:
    stub = tmp_path / "no_numpy" / "numpy"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text(
        'raise ModuleNotFoundError("numpy is hidden by this test", name="numpy")\n'
    )
    # PYTHONPATH reaches the spawned ranks too (they start fresh interpreters).
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(stub.parent), _SRC])}
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, env=env, timeout=600, check=False
    )


def test_the_stub_reproduces_a_torch_only_environment(tmp_path):
    # Negative check: inside the stubbed environment torch's numpy bridge really is gone.
    proc = _run_without_numpy(tmp_path, ["-c", "import torch; torch.zeros(1).numpy()"])
    assert proc.returncode != 0
    assert "Numpy is not available" in proc.stderr


@pytest.mark.distributed
def test_demo_runs_without_numpy_or_matplotlib(tmp_path):
    out = tmp_path / "demo"
    proc = _run_without_numpy(
        tmp_path,
        [
            "-m", "splitgrad", "demo", "--steps", "2", "--hidden-size", "32", "--num-layers", "2",
            "--num-heads", "2", "--seq-len", "16", "--batch-size", "4", "--microbatches", "2",
            "--max-chars", "20000", "--out", str(out), "--timeout", "120",
        ],
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "| 1f1b | 2 |" in proc.stdout and "| zb-h1 | 2 |" in proc.stdout
    assert "max |loss difference| 1f1b vs zb-h1 over 2 steps: 0.00e+00" in proc.stdout
    assert "matplotlib is not installed" in proc.stdout
    # The JSON outputs only: timelines and the per-step metrics (no pictures without matplotlib).
    assert {p.name for p in out.iterdir()} == {
        "timeline_1f1b.json", "timeline_zb-h1.json", "metrics_1f1b.jsonl", "metrics_zb-h1.jsonl"
    }  # fmt: skip
