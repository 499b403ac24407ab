"""The main job (`python -m splitgrad demo`) end to end on 2 local gloo ranks, at a tiny size.

Why: the README's first command must work on a fresh machine; this runs the same code path (spawned ranks,
pipeline runtime, both schedules, pictures) in seconds and checks what it promises to print and write.
"""

from __future__ import annotations

import pytest

from splitgrad.__main__ import main
from splitgrad.cli.demo import DemoConfig, stages_for


@pytest.mark.distributed
def test_demo_trains_both_schedules_identically_and_writes_pictures(tmp_path, capfd):
    out = tmp_path / "demo"
    code = main([
        "demo", "--steps", "3", "--hidden-size", "32", "--num-layers", "2", "--num-heads", "2",
        "--seq-len", "16", "--batch-size", "4", "--microbatches", "2", "--max-chars", "20000",
        "--out", str(out), "--timeout", "60",
    ])  # fmt: skip
    assert code == 0
    text = capfd.readouterr().out
    assert "| 1f1b | 2 |" in text and "| zb-h1 | 2 |" in text
    assert "measured bubble" in text and "simulated" in text
    assert "max |loss difference| 1f1b vs zb-h1 over 3 steps: 0.00e+00" in text
    names = {p.name for p in out.iterdir()}
    assert {"loss_curve.png", "timeline_1f1b.json", "timeline_1f1b.png", "timeline_zb-h1.png"} <= names


def test_stages_for_schedules_with_two_stages_per_rank():
    assert stages_for("1f1b", 2, 4) == 2
    assert stages_for("zbv", 2, 4) == 4
    assert stages_for("zb-h1", 3, 4) == 3


def test_demo_config_rejects_bad_values():
    with pytest.raises(ValueError, match=r"batch_size.*microbatches"):
        DemoConfig(batch_size=6, microbatches=4)
    with pytest.raises(ValueError, match="steps=0"):
        DemoConfig(steps=0)
