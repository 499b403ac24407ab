"""``python -m splitgrad demo``: every user mistake is one ``error:`` line and exit 2 before any rank starts;
two-stages-per-rank schedules get ``2 x ranks`` stages; ``--help`` shows defaults; Ctrl-C exits 130 quietly.

Why: the demo is the first command people run. A typo used to surface as a traceback from inside a spawned
rank (or a ``ZeroDivisionError`` for ``--microbatches 0``), and ``--ranks 3 --schedules zbv`` failed on every
rank with "n_stages must be even, got n_stages=3".
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import splitgrad.cli.demo as demo
from splitgrad.__main__ import main
from splitgrad.cli.demo import DemoConfig, check_config, stages_for, stages_per_rank
from splitgrad.pipeline.schedules import schedule_names

SRC = Path(__file__).resolve().parents[2] / "src"
TINY = ["--steps", "1", "--hidden-size", "16", "--num-heads", "2", "--seq-len", "8", "--max-chars", "2000"]


@pytest.fixture
def no_spawn(monkeypatch):
    """Fails the test if the demo got as far as starting ranks; records the config it would have run."""
    started: list[DemoConfig] = []

    def fake(cfg: DemoConfig) -> int:
        started.append(cfg)
        return 0

    monkeypatch.setattr(demo, "_spawn_local", fake)
    return started


BAD = {
    "unknown-schedule": (
        ["--schedules", "1f1b,nope"],
        r"argument --schedules: unknown schedule 'nope'; choose from gpipe",
    ),
    "no-schedule": (["--schedules", " , "], r"argument --schedules: needs at least one schedule name"),
    "ranks-0": (["--ranks", "0"], r"argument --ranks: must be an integer >= 1, got 0"),
    "ranks-negative": (["--ranks=-1"], r"argument --ranks: must be an integer >= 1, got -1"),
    "ranks-not-int": (["--ranks", "two"], r"argument --ranks: must be an integer, got 'two'"),
    "microbatches-0": (["--microbatches", "0"], r"argument --microbatches: must be an integer >= 1, got 0"),
    "lr-0": (["--lr", "0"], r"argument --lr: must be a finite number > 0, got 0"),
    "timeout-nan": (["--timeout", "nan"], r"argument --timeout: must be a finite number > 0, got nan"),
    "seed-negative": (["--seed=-3"], r"argument --seed: must be an integer >= 0, got -3"),
    "batch-not-multiple": (
        ["--batch-size", "6", "--microbatches", "4"],
        r"invalid batch_size=6 \(batch_size must",
    ),
    "heads": (["--num-heads", "3"], r"num_heads must divide hidden_size, got hidden_size=256 num_heads=3"),
    "ranks-over-layers": (
        ["--ranks", "5"],
        r"schedule 1f1b on 5 rank\(s\) needs 5 stages .* --num-layers is 4",
    ),
    "zbv-stages-over-layers": (
        ["--ranks", "3", "--schedules", "zbv"],
        r"schedule zbv on 3 rank\(s\) needs 6 stages .* --num-layers is 4; use --num-layers >= 6",
    ),
    "interleaved-microbatches": (
        ["--ranks", "3", "--schedules", "interleaved-1f1b", "--num-layers", "6"],
        r"interleaved-1f1b on 3 rank\(s\) \(6 stages\) with 8 microbatches: .*multiple of the number of ranks",
    ),
    "dualpipev-microbatches": (
        [
            "--ranks",
            "3",
            "--schedules",
            "dualpipev",
            "--num-layers",
            "6",
            "--microbatches",
            "4",
            "--batch-size",
            "8",
        ],
        r"dualpipev on 3 rank\(s\) \(6 stages\) with 4 microbatches: .*at least as many microbatches as stages",
    ),
    "corpus-too-small": (["--max-chars", "100"], r"--max-chars 100 is too small for --seq-len 128"),
}


@pytest.mark.parametrize("case", list(BAD), ids=str)
def test_user_mistakes_exit_2_with_one_error_line_before_spawning(case, no_spawn, capsys, tmp_path):
    argv, pattern = BAD[case]
    with pytest.raises(SystemExit) as info:
        main(["demo", *argv, "--out", str(tmp_path / "out")])
    assert info.value.code == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1 and errors[0].startswith("splitgrad demo: error: "), err
    assert "Traceback" not in err
    assert re.search(pattern, errors[0]), errors[0]
    assert no_spawn == []


@pytest.mark.parametrize("out", ["file/sub", "file"])
def test_unusable_out_folder_is_an_error(out, no_spawn, capsys, tmp_path):
    (tmp_path / "file").write_text("not a folder")
    with pytest.raises(SystemExit) as info:
        main(["demo", "--out", str(tmp_path / out)])
    assert info.value.code == 2
    assert f"error: --out {tmp_path / out}: cannot create the folder" in capsys.readouterr().err
    assert no_spawn == []


def test_valid_arguments_reach_the_spawn_with_the_right_config(no_spawn, tmp_path):
    """Not trivially rejecting: good arguments pass every check, as the config the user asked for."""
    out = tmp_path / "new" / "out"
    argv = ["demo", "--ranks", "3", "--schedules", "zbv,dualpipev,interleaved-1f1b", "--num-layers", "6"]
    assert main([*argv, "--microbatches", "6", "--batch-size", "12", "--out", str(out)]) == 0
    (cfg,) = no_spawn
    assert (
        cfg.schedules == ("zbv", "dualpipev", "interleaved-1f1b") and cfg.ranks == 3 and cfg.batch_size == 12
    )
    assert out.is_dir()


def test_help_shows_defaults(capsys):
    with pytest.raises(SystemExit) as info:
        main(["demo", "--help"])
    assert info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    defaults = DemoConfig()
    for flag, value in (("ranks", defaults.ranks), ("microbatches", defaults.microbatches),
                        ("lr", defaults.lr), ("out", defaults.out)):  # fmt: skip
        assert f"--{flag}" in text and f"(default: {value})" in text
    assert "(default: 1f1b,zb-h1)" in text


def test_two_stages_per_rank_schedules_get_twice_the_ranks():
    per_rank = {name: stages_per_rank(name) for name in schedule_names()}
    assert per_rank == {
        n: 2 if n in ("zbv", "zbv-auto", "dualpipev", "interleaved-1f1b", "v-half", "v-min") else 1
        for n in schedule_names()
    }
    assert stages_for("zbv", 3, 8) == 6  # used to fail on every rank: "n_stages must be even, got n_stages=3"
    assert stages_for("dualpipev", 3, 8) == 6
    assert stages_for("interleaved-1f1b", 3, 6) == 6
    assert stages_for("zb-h1", 3, 4) == 3
    for name in schedule_names():  # --ranks 1 runs every schedule
        assert stages_for(name, 1, 2) == per_rank[name]
    check_config(DemoConfig(ranks=1, schedules=tuple(schedule_names()), microbatches=2, batch_size=2))
    with pytest.raises(ValueError, match=r"dualpipev on 2 rank\(s\) \(4 stages\) with 2 microbatches"):
        stages_for("dualpipev", 2, 2)


def test_demo_config_never_divides_by_zero():
    with pytest.raises(ValueError, match=r"invalid microbatches=0$"):
        DemoConfig(microbatches=0)


@pytest.mark.distributed
def test_one_rank_runs_a_two_stages_per_rank_schedule(tmp_path, capfd):
    """``--ranks 1 --schedules zbv`` puts both V stages on one process and trains like 1f1b's single stage."""
    argv = ["demo", "--ranks", "1", "--schedules", "1f1b,zbv", "--num-layers", "2", "--microbatches", "2"]
    code = main([*argv, "--batch-size", "4", *TINY, "--timeout", "60", "--out", str(tmp_path)])
    text = capfd.readouterr().out
    assert code == 0, text
    assert "| 1f1b | 1 |" in text and "| zbv | 2 |" in text
    assert "max |loss difference| 1f1b vs zbv over 1 steps: 0.00e+00" in text


@pytest.mark.distributed
@pytest.mark.skipif(sys.platform == "win32", reason="process groups and SIGINT are POSIX")
def test_ctrl_c_stops_the_ranks_without_a_traceback(tmp_path):
    """Ctrl-C in a terminal signals the whole process group: the parent and both ranks."""
    argv = ["demo", "--ranks", "2", "--num-layers", "2", "--microbatches", "2", "--batch-size", "4", *TINY]
    argv[argv.index("--steps") + 1] = "100000"  # still training when interrupted
    env = dict(os.environ, PYTHONPATH=str(SRC))
    # As in a terminal: SIGINT at its default disposition. A test run started in the background of a
    # non-interactive shell (`make test &`) inherits it *ignored*, and so would the demo (rightly deaf to it).
    proc = subprocess.Popen(
        [sys.executable, "-m", "splitgrad", *argv, "--out", str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    try:
        for line in proc.stdout:  # rank 0 prints this once both ranks are up
            if line.startswith("corpus:"):
                break
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, err
    assert [line for line in err.splitlines() if line.strip()] == [
        "splitgrad demo: interrupted, ranks stopped"
    ]
