"""``python -m splitgrad schedule``: output paths are checked before any work, and the path reported is the
file actually written.

Why: an unwritable ``--png``/``--trace`` used to end in a traceback (exit 1) after the simulation, and
``--png zb`` reported "wrote zb" while matplotlib wrote ``zb.png``.
"""

from __future__ import annotations

import re

import pytest

from splitgrad.__main__ import main
from splitgrad.cli import schedule as schedule_cli

ARGS = ["schedule", "zb-h1", "--stages", "2", "--microbatches", "2"]


def _errors(err: str) -> list[str]:
    assert "Traceback" not in err
    return [line for line in err.splitlines() if "error:" in line]


def test_png_without_suffix_reports_the_file_it_wrote(tmp_path, capsys, monkeypatch):
    pytest.importorskip("matplotlib")
    monkeypatch.chdir(tmp_path)
    assert main([*ARGS, "--png", "zb"]) == 0
    assert "wrote zb.png" in capsys.readouterr().out
    assert [p.name for p in tmp_path.iterdir()] == ["zb.png"]
    assert (tmp_path / "zb.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize(
    ("flag", "path", "match"),
    [
        ("--png", "missing/zb.png", r"error: --png .*missing/zb\.png: folder .*missing does not exist"),
        ("--trace", "missing/t.json", r"error: --trace .*missing/t\.json: folder .*missing does not exist"),
        ("--trace", ".", r"error: --trace .*: is a folder, not a file"),
        ("--png", "file/zb.png", r"error: --png .*file/zb\.png: folder .*file does not exist"),
    ],
)
def test_unwritable_outputs_exit_2_before_simulating(flag, path, match, tmp_path, capsys, monkeypatch):
    (tmp_path / "file").write_text("not a folder")
    monkeypatch.chdir(tmp_path)

    def no_simulation(*args, **kwargs):
        raise AssertionError("simulated although the output path is unusable")

    monkeypatch.setattr("splitgrad.pipeline.simulate", no_simulation)
    assert main([*ARGS, flag, path]) == 2
    captured = capsys.readouterr()
    (line,) = _errors(captured.err)
    assert re.search(match, line), line
    assert captured.out == ""


def test_a_write_refused_by_the_file_system_is_one_error_line(tmp_path, capsys, monkeypatch):
    """Permission checks can pass (root) and the write still fail: still exit 2, no traceback."""

    def refuse(events, path, **kwargs):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr("splitgrad.pipeline.timeline.write_chrome_trace", refuse)
    assert main([*ARGS, "--trace", str(tmp_path / "t.json")]) == 2
    (line,) = _errors(capsys.readouterr().err)
    assert line == f"error: could not write {tmp_path / 't.json'}: Permission denied"


def test_output_path_accepts_writable_paths(tmp_path):
    """Not trivially rejecting: a writable folder passes, and '.png' is only added when missing."""
    assert schedule_cli.output_path("--png", str(tmp_path / "a.png"), ".png") == tmp_path / "a.png"
    assert schedule_cli.output_path("--png", str(tmp_path / "a.PNG"), ".png") == tmp_path / "a.PNG"
    assert schedule_cli.output_path("--png", str(tmp_path / "a.v1"), ".png") == tmp_path / "a.v1.png"
    assert schedule_cli.output_path("--trace", str(tmp_path / "t"), None) == tmp_path / "t"
    assert schedule_cli.output_path("--trace", None) is None


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--microbatches", "0"], r"^error: zb-h1: n_microbatches must be an integer >= 1, got 0"),
        (["--stages=-1"], r"^error: zb-h1: n_stages must be an integer >= 1, got -1"),
    ],
)
def test_bad_counts_exit_2(argv, match, capsys):
    assert main(["schedule", "zb-h1", *argv]) == 2
    (line,) = _errors(capsys.readouterr().err)
    assert re.search(match, line), line


def test_ctrl_c_exits_130_with_one_line(capsys, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("splitgrad.pipeline.simulate", interrupted)
    assert main(ARGS) == 130
    err = capsys.readouterr().err
    assert [line for line in err.splitlines() if line.strip()] == ["splitgrad schedule: interrupted"]
