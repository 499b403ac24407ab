"""A checkpoint is refused while weight-gradient work is owed, naming it; it is taken once the work is drained.

Why: the weights and optimizer state of a checkpoint must be those of a finished step. A stage that still owes
``backward_dw`` work has gradients that are not all there: saving (or restoring over it) would lose them.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import splitgrad
from splitgrad.pipeline import build_runtime
from splitgrad.pipeline.checkpoint import PipelineCheckpointer, latest_checkpoint


def test_save_and_load_refuse_owed_wgrad_naming_it(tmp_path):
    torch.manual_seed(0)
    stage = torch.nn.Sequential(splitgrad.Linear(4, 4, delay_wgrad_compute=True), torch.nn.Tanh())
    rt = build_runtime([stage], "1f1b", n_microbatches=2, loss_fn=F.mse_loss, record_timeline=False)
    opt = torch.optim.AdamW(rt.parameters())
    ckpt = PipelineCheckpointer(tmp_path, rt, stage, opt)
    stage(torch.randn(2, 4)).sum().backward()  # the input gradient now, the weight gradient owed
    assert splitgrad.pending_wgrad(stage) == 1
    for call in (lambda: ckpt.save(1), ckpt.load):
        # Where, and what is owed: module "0" of the stage, one deferred weight gradient.
        with pytest.raises(
            RuntimeError, match=r"PipelineCheckpointer\.(save|load) \(stage 0\).*Owed by: 0 \(pending=1"
        ):
            call()
    assert latest_checkpoint(tmp_path) is None  # nothing was written
    stage[0].backward_dw()
    assert splitgrad.pending_wgrad(stage) == 0
    ckpt.save(1)
    assert latest_checkpoint(tmp_path) is not None
    ckpt.close()
