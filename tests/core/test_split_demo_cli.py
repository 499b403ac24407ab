"""`python -m splitgrad split` runs end to end and reports bitwise-equal training."""

from __future__ import annotations

import argparse

from splitgrad.cli import split_demo as demo


def test_demo_runs_and_is_bitwise_equal(capsys):
    parser = argparse.ArgumentParser()
    demo.add_parser(parser.add_subparsers())
    args = parser.parse_args(["split", "--steps", "2", "--hidden", "32", "--tokens", "16"])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "bitwise equal (immediate vs deferred): True" in out
    assert "optimizer.step() refused" in out
