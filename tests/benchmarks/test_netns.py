"""``benchmarks/_netns.py``: the rate-limited namespace is deleted however its command ends.

Why: a namespace left behind keeps its name taken and, worse, a later run in it would measure nothing like
what the docs say. Ctrl-C always cleaned up; a SIGTERM (``kill``, ``timeout``) used to end the harness by
Python's default action, skipping the cleanup.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "_netns.py"


def _namespaces() -> set[str]:
    done = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    return {line.split()[0] for line in done.stdout.splitlines() if line.strip()}


@pytest.mark.skipif(
    os.geteuid() != 0 or not (shutil.which("ip") and shutil.which("tc")), reason="needs root, ip and tc"
)
def test_sigterm_deletes_the_namespace():
    harness = subprocess.Popen([sys.executable, str(SCRIPT), "--rate", "1gbit", "--", "sleep", "60"])
    name = f"splitgrad-bench-{harness.pid}"
    try:
        deadline = time.monotonic() + 30
        while name not in _namespaces():  # created before the command starts
            assert harness.poll() is None, "the harness exited before creating its namespace"
            assert time.monotonic() < deadline, "no namespace after 30 s"
            time.sleep(0.1)
        harness.send_signal(signal.SIGTERM)
        code = harness.wait(timeout=30)
    finally:
        if harness.poll() is None:
            harness.kill()
            harness.wait()
    leftover = name in _namespaces()
    if leftover:
        subprocess.run(["ip", "netns", "delete", name], capture_output=True)
    assert not leftover, f"{name} was left behind after SIGTERM"
    assert code != 0, "the command was cut short: the harness must not report success"
