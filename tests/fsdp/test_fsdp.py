"""splitgrad.parallel.defer_fsdp_reduction: FSDP2 (fully_shard) with deferred wgrad, fsdp=4 on gloo ranks.

Why: without it a delayed layer under FSDP2 writes a full, unreduced gradient onto a sharded DTensor parameter
(now refused, naming the fix). With it, each FSDP2 group reduce-scatters its deferred gradients at its last W
(in that task, at ``finish()``, or on a background thread joined by ``finish()``/the next forward), through
FSDP2's own reduction, so the sharded ``.grad`` must equal immediate mode bitwise and the float64
single-process reference after ``full_tensor()``: one microbatch, accumulation with sync only on the last,
W after each B or all at the end, ``reshard_after_forward`` both ways, a mixed-precision reduce dtype; and
misuse is a clear error; ``fsdp_reduction_handle`` finds the handle of every layer set up, and none elsewhere.
Runs in the package's one spawn (conftest.py); each check is its own test.
"""

from __future__ import annotations

import pytest

from tests.fsdp import fsdp_checks
from tests.fsdp.all_checks import failures

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("name", [f.__name__ for f in fsdp_checks.CHECKS])
def test_fsdp(fsdp_results, name):
    assert not failures(fsdp_results, name)
