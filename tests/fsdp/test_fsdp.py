"""splitgrad.parallel.defer_fsdp_reduction: FSDP2 (fully_shard) with deferred wgrad on 2 gloo ranks.

Why: without it a delayed layer under FSDP2 writes a full, unreduced gradient onto a sharded DTensor parameter
(now refused, naming the fix). With it, each FSDP2 group reduce-scatters its deferred gradients at its last W,
through FSDP2's own reduction, so the sharded ``.grad`` must equal immediate mode bitwise and the float64
single-process reference after ``full_tensor()``: one microbatch, accumulation with sync only on the last,
W after each B or all at the end, ``reshard_after_forward`` both ways, a mixed-precision reduce dtype; and
misuse is a clear error. All checks run in one spawn; each is reported as its own test.
"""

from __future__ import annotations

import pytest

from splitgrad.testing import spawn
from tests.fsdp import fsdp_checks

pytestmark = pytest.mark.distributed

NAMES = [f.__name__ for f in fsdp_checks.WORLD2]


@pytest.fixture(scope="module")
def results() -> list[dict[str, str | None]]:
    return spawn(fsdp_checks.run_checks, 2, NAMES, timeout=300, pg_timeout=60)


@pytest.mark.parametrize("name", NAMES)
def test_two_ranks(results, name):
    failures = [f"--- rank {r} ---\n{res[name]}" for r, res in enumerate(results) if res[name] is not None]
    assert not failures, "\n".join(failures)
