"""splitgrad layers inside torch.distributed.pipelining's PipelineStage and schedules, on 2 gloo ranks.

Why: the adapter replaces PyTorch's autograd-graph surgery for the W step with splitgrad's parked wgrad
bundles, keyed by microbatch through PyTorch's ``dw_builder`` hook. These checks prove that every gradient
and loss equals a single-process float64 reference of plain torch layers under ``Schedule1F1B``,
``ScheduleInterleavedZeroBubble`` and ``ScheduleZBVZeroBubble``, on 2-D tokens and on 3-D (batch, seq,
hidden) activations where PyTorch's own I/W split raises "Can't detach views in-place" (also checked, so
the documented bug is noticed when PyTorch fixes it); and that sabotaged W bookkeeping (a runner handed
to the wrong microbatch, a W that never runs) and misuse are loud errors, not wrong gradients.

All checks run in one spawn (process start-up and torch import cost seconds); each is its own test.
"""

from __future__ import annotations

import pytest
from torch import nn

import splitgrad
from splitgrad.pipeline.torch_adapter import splitgrad_pipeline_stage
from splitgrad.testing import spawn
from tests.helpers import rank_failures
from tests.torch_adapter import adapter_checks

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def results() -> list[dict[str, str | None]]:
    return spawn(adapter_checks.run_checks, 2, adapter_checks.ALL, timeout=180, pg_timeout=30)


@pytest.mark.parametrize("name", adapter_checks.ALL)
def test_two_ranks(results, name):
    failures = rank_failures(results, name)
    assert not failures, failures


def test_stage_without_delayed_layers_is_refused():
    """Checked before PyTorch's constructor, so no process group is needed."""
    immediate = nn.Sequential(
        splitgrad.Linear(4, 4), nn.GELU(), splitgrad.Linear(4, 4, delay_wgrad_compute=True)
    )
    with pytest.raises(ValueError, match=r"\['0'\] were built without delay_wgrad_compute=True"):
        splitgrad_pipeline_stage(immediate, 0, 2, "cpu")
    with pytest.raises(ValueError, match="contains no splitgrad layer"):
        splitgrad_pipeline_stage(nn.Sequential(nn.Linear(4, 4)), 0, 2, "cpu")
