"""Tensor-parallel ``splitgrad.Linear`` on 2 and 3 gloo ranks, float64, against the full single-process layer.

Why: sharding, the collectives and the deferred W task under sequence parallelism (which needs the gathered
input) are where a gradient gets lost, counted twice or taken from the wrong shard. One spawn per rank count
runs every check; each is reported as its own test.
"""

from __future__ import annotations

import pytest

from splitgrad.testing import spawn
from tests.tensor_parallel import tp_checks, tp_gpt_checks, tp_keyword_checks, tp_module_checks

pytestmark = pytest.mark.distributed

NAMES = tp_checks.ALL + tp_module_checks.ALL + tp_keyword_checks.ALL + tp_gpt_checks.ALL


@pytest.fixture(scope="module")
def results() -> dict[int, list[dict[str, object]]]:
    return {w: spawn(tp_checks.run_checks, w, NAMES, timeout=300, pg_timeout=60) for w in (2, 3)}


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("name", NAMES)
def test_tp_linear(results, world, name):
    failures = [
        f"--- rank {r} ---\n{res[name]}" for r, res in enumerate(results[world]) if res[name] is not None
    ]
    assert not failures, "\n".join(failures)
