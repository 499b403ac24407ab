"""FSDP2-sharded pipeline stages (pp=2 x fsdp=2 on 4 gloo ranks): splitgrad's runtime (1f1b, zb-h1) and
PyTorch's ScheduleZBVZeroBubble through the splitgrad adapter.

Why: the runtime drives data-parallel sync through the schedule's R/RF points; an FSDP2 stage must
reduce-scatter its deferred gradients inside its last W and leave sharded gradients equal to the float64
single-process reference of the whole batch; under PyTorch's schedule the held deferred gradients join
FSDP2's reduction at each stage's REDUCE_GRAD (after its last W). One spawn of 4 ranks.
"""

from __future__ import annotations

import pytest

from splitgrad.testing import spawn
from tests.fsdp import pipeline_checks

pytestmark = pytest.mark.distributed


NAMES = [f.__name__ for f in pipeline_checks.CHECKS]


@pytest.fixture(scope="module")
def results() -> list[dict[str, str | None]]:
    return spawn(pipeline_checks.run_checks, 4, NAMES, timeout=400, pg_timeout=120)


@pytest.mark.parametrize("name", NAMES)
def test_four_ranks(results, name):
    failures = [f"--- rank {r} ---\n{res[name]}" for r, res in enumerate(results) if res[name] is not None]
    assert not failures, "\n".join(failures)
