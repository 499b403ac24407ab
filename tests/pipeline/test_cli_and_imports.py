"""The ``schedule`` CLI command, and that the schedule layer stays light (no torch, matplotlib only lazily).

Why: the CLI is how people look at schedules, and the runtime's users import the schedule layer in every
process, so it must not pull heavy dependencies in at import time.
"""

from __future__ import annotations

import argparse
import ast
import subprocess
import sys
from pathlib import Path

import pytest

from splitgrad.cli.schedule import add_parser, parse_costs

SRC = Path(__file__).resolve().parents[2] / "src" / "splitgrad"


def _run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="splitgrad")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def test_cli_prints_bubble_and_memory(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    png, trace = tmp_path / "out.png", tmp_path / "out.json"
    code = _run(
        [
            "schedule",
            "zb-h1",
            "--stages",
            "4",
            "--microbatches",
            "8",
            "--png",
            str(png),
            "--trace",
            str(trace),
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "bubble 11.11%" in out and "peak activations per rank: 4 4 4 4" in out
    assert png.read_bytes()[:4] == b"\x89PNG" and trace.stat().st_size > 0


def test_cli_ascii_text_and_auto(capsys):
    assert (
        _run(
            ["schedule", "zb-auto", "--stages", "3", "--microbatches", "5", "--memory-limit", "5", "--ascii"]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "schedule zb-auto" in out and "r2  |" in out
    # zbv-auto plans with the CLI's costs: W twice F gives zero bubble where the fixed zbv has 3.03 %.
    args = ["--stages", "8", "--microbatches", "8", "--w", "2"]
    assert _run(["schedule", "zbv-auto", *args]) == 0 and "bubble 0.00%" in capsys.readouterr().out
    assert _run(["schedule", "zbv", *args]) == 0 and "bubble 3.03%" in capsys.readouterr().out
    assert _run(["schedule", "1f1b", "--stages", "2", "--microbatches", "2", "--text", "--b", "2,1"]) == 0
    assert "rank 1: 1F0 1BW0 1F1 1BW1" in capsys.readouterr().out


def test_cli_errors(capsys):
    assert _run(["schedule", "interleaved-1f1b", "--stages", "8", "--microbatches", "6"]) == 2
    assert "multiple of the number of ranks" in capsys.readouterr().err
    assert _run(["schedule", "1f1b", "--stages-per-rank", "2"]) == 2
    assert "does not take option" in capsys.readouterr().err
    assert _run(["schedule", "1f1b", "--stages", "3", "--f", "1,2"]) == 2
    assert "one cost per stage" in capsys.readouterr().err
    with pytest.raises(argparse.ArgumentTypeError):
        parse_costs("fast")
    assert parse_costs("1,2.5") == [1.0, 2.5] and parse_costs("3") == 3.0


def _top_level_imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


SCHEDULE_LAYER = [
    "pipeline/__init__.py",
    "pipeline/actions.py",
    "pipeline/_coerce.py",
    "pipeline/_engine.py",
    "pipeline/_perf.py",
    "pipeline/simulate.py",
    "pipeline/timeline.py",
    "pipeline/validate.py",
    "cli/schedule.py",
    *(f"pipeline/schedules/{p.name}" for p in (SRC / "pipeline" / "schedules").glob("*.py")),
]


@pytest.mark.parametrize("relpath", SCHEDULE_LAYER)
def test_no_heavy_imports_at_module_level(relpath):
    assert not _top_level_imports(SRC / relpath) & {"torch", "matplotlib", "numpy"}


def test_importing_the_schedule_layer_loads_neither_torch_nor_matplotlib():
    """Import the schedule modules with ``splitgrad`` and ``splitgrad.pipeline`` as bare namespaces: their
    ``__init__`` files also export torch-based code (layers, runtime), which is not what is measured here."""
    code = f"""
import sys, types
for name, path in (("splitgrad", {str(SRC)!r}), ("splitgrad.pipeline", {str(SRC / "pipeline")!r})):
    module = types.ModuleType(name)
    module.__path__ = [path]
    sys.modules[name] = module
import splitgrad.pipeline.schedules.registry, splitgrad.pipeline.simulate, splitgrad.pipeline.timeline
import splitgrad.pipeline.validate, splitgrad.cli.schedule
from splitgrad.pipeline.schedules.registry import build_schedule
assert build_schedule("zbv", 4, 3).n_ranks == 2
print(sorted(m for m in ("torch", "matplotlib", "numpy") if m in sys.modules))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
