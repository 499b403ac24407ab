"""Pipeline runtime with FSDP2-sharded stages (pp=2 x fsdp=2 on 4 gloo ranks), 1f1b and zb-h1.

Why: the runtime drives data-parallel sync through the schedule's R/RF points; an FSDP2 stage must
reduce-scatter its deferred gradients inside its last W and leave sharded gradients equal to the float64
single-process reference of the whole batch. One spawn of 4 ranks.
"""

from __future__ import annotations

import pytest

from splitgrad.testing import spawn
from tests.fsdp import pipeline_checks

pytestmark = pytest.mark.distributed


def test_pipeline_runtime_with_fsdp2_stages():
    results = spawn(pipeline_checks.run_checks, 4, ["check_pipeline_fsdp"], timeout=400, pg_timeout=120)
    failures = [
        f"--- rank {r} ---\n{res['check_pipeline_fsdp']}"
        for r, res in enumerate(results)
        if res["check_pipeline_fsdp"]
    ]
    assert not failures, "\n".join(failures)
