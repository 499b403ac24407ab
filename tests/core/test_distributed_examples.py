"""The multi-rank examples run as their docstrings say (``torchrun --nproc-per-node 2 examples/<script>``) and
train what one process trains. They are documentation users copy: a test that mirrors their code cannot notice
when the script itself stops working."""

from __future__ import annotations

import re
import runpy
from pathlib import Path

import pytest
import torch

from tests.helpers import run_torchrun

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).parents[2]


def run_example(script: str) -> str:
    """``torchrun --standalone --nproc-per-node 2 examples/<script>`` from the repository root; its stdout."""
    proc = run_torchrun([f"examples/{script}"], ranks=2, cwd=ROOT)
    assert proc.returncode == 0, f"examples/{script} failed (rc={proc.returncode}):\n{proc.stderr[-4000:]}"
    return proc.stdout


def printed_losses(out: str, label: str) -> list[float]:
    """The list printed after ``<label>, loss per step:``."""
    found = re.search(rf"^{re.escape(label)}, loss per step: \[([^\]]*)\]$", out, flags=re.M)
    assert found is not None, f"no {label!r} line in:\n{out}"
    return [float(v) for v in found.group(1).split(",")]


def hf_moe_reference(example: dict, *, world: int = 2) -> tuple[list[float], list[float]]:
    """The losses ``examples/hf_moe.py`` prints, from one process training the unconverted model on the whole
    batches: per step of the expert-parallel part, every rank's batch; of the pipeline part, the one batch."""
    from splitgrad.models import lm_loss

    def train(batches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[float]:
        model = example["tiny_qwen3_moe"]()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        losses = []
        for ids, targets in batches:
            loss = lm_loss(model(input_ids=ids).logits, targets)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses

    def whole(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        parts = [example["batch"](seed=step * world + rank) for rank in range(world)]
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])

    return train([whole(step) for step in range(3)]), train(
        [example["batch"](seed=100 + s) for s in range(2)]
    )


def test_hf_moe_example_trains_what_one_process_trains():
    out = run_example("hf_moe.py")
    example = runpy.run_path(str(ROOT / "examples" / "hf_moe.py"), run_name="example")
    ep_want, pp_want = hf_moe_reference(example)
    ep, pp = printed_losses(out, "expert parallel"), printed_losses(out, "zb-h1 pipeline")
    # Printed to 4 decimals; float32 with grouped_mm on one side, the eager experts' sum order on the other.
    torch.testing.assert_close(torch.tensor(ep), torch.tensor(ep_want), rtol=0, atol=2e-4)
    torch.testing.assert_close(torch.tensor(pp), torch.tensor(pp_want), rtol=0, atol=2e-4)
    # The comparison can fail: the reference of other batches (one seed off) is rejected.
    shifted = {**example, "batch": lambda seed, **kw: example["batch"](seed + 1, **kw)}
    with pytest.raises(AssertionError):
        torch.testing.assert_close(
            torch.tensor(ep), torch.tensor(hf_moe_reference(shifted)[0]), rtol=0, atol=2e-4
        )


def test_torchtitan_example_matches_one_process():
    out = run_example("torchtitan_zero_bubble.py")
    worst = [float(v) for v in re.findall(r"max \|grad - reference\| = (\S+)$", out, flags=re.M)]
    assert len(worst) == 2, out  # one line per rank
    assert max(worst) <= 1e-10, out  # float64: the schedule's sums against one process's
    losses = re.findall(r"losses \[([^\]]*)\]", out)
    assert len(losses) == 1 and len(losses[0].split(",")) == 4, (
        out
    )  # the last stage's rank, one per microbatch
