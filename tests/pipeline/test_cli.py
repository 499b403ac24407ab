"""The ``schedule`` CLI command: bubble and memory lines, the ASCII/text views, the cost-aware planners, errors.

Why: the CLI is how people look at schedules. That it stays light (no torch, matplotlib only lazily) is
checked with the rest of the schedule layer in ``test_torch_free.py``.
"""

from __future__ import annotations

import argparse

import pytest

from splitgrad.cli.schedule import add_parser, parse_costs


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
