"""The runnable examples stay runnable (they are documentation users copy)."""

from __future__ import annotations

import runpy
from pathlib import Path


def test_quickstart_example_runs_and_matches_autograd(capsys):
    runpy.run_path(str(Path(__file__).parents[2] / "examples" / "quickstart.py"), run_name="__main__")
    out = capsys.readouterr().out
    assert "gradients equal plain autograd: True" in out
    assert "optimizer.step() refused" in out
