"""FSDP2-sharded pipeline stages (pp=2 x fsdp=2 on 4 gloo ranks): splitgrad's runtime (1f1b, zb-h1) and
PyTorch's ScheduleZBVZeroBubble and ScheduleInterleavedZeroBubble through the splitgrad adapter.

Why: the runtime drives data-parallel sync through the schedule's R/RF points; an FSDP2 stage's deferred
reduce-scatter is the RF action (or starts in the background at the stage's last W and RF joins it), shows as
its own comm event of the stage in the measured timeline after the last W, and leaves sharded gradients equal
to the float64 single-process reference of the whole batch; under PyTorch's schedules the held deferred
gradients join FSDP2's reduction at each stage's REDUCE_GRAD (after its last W). Runs in the package's one
spawn (conftest.py).
"""

from __future__ import annotations

import pytest

from tests.fsdp import pipeline_checks
from tests.fsdp.all_checks import failures

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("name", [f.__name__ for f in pipeline_checks.CHECKS])
def test_pipeline_fsdp(fsdp_results, name):
    assert not failures(fsdp_results, name)
