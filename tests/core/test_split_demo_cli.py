"""`python -m splitgrad split` runs end to end and reports bitwise-equal training."""

from __future__ import annotations

import argparse

import pytest

from splitgrad.__main__ import main
from splitgrad.cli import split_demo as demo


def test_demo_runs_and_is_bitwise_equal(capsys):
    parser = argparse.ArgumentParser()
    demo.add_parser(parser.add_subparsers())
    args = parser.parse_args(["split", "--steps", "2", "--hidden", "32", "--tokens", "16"])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "bitwise equal (immediate vs deferred): True" in out
    assert "optimizer.step() refused" in out


@pytest.mark.parametrize("argv", [["--steps", "0"], ["--hidden", "0"], ["--tokens=-1"], ["--steps", "x"]])
def test_bad_counts_are_one_error_line_and_exit_2(argv, capsys):
    """``--hidden 0`` used to be a traceback from inside splitgrad.Linear (exit 1), ``--steps 0`` ran nothing."""
    with pytest.raises(SystemExit) as info:
        main(["split", *argv])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1 and errors[0].startswith(
        f"splitgrad split: error: argument {argv[0].split('=')[0]}:"
    )
