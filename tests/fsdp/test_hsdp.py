"""splitgrad.parallel.defer_fsdp_reduction under HSDP: a 2-D FSDP2 mesh (replicate=2 x shard=2) on 4 gloo ranks.

Why: HSDP reduce-scatters over the shard dim and then all-reduces over the replicate dim; the deferred
reduction (each ``mode``) must go through both, exactly once, with the all-reduce flags of the moment the
group's last W ran. Sharded ``.grad`` bitwise against FSDP2 immediate mode on the same mesh, ``full_tensor()``
against the float64 reference, and a negative check that a skipped all-reduce or a doubled gradient fails.
Runs in the package's one spawn (conftest.py); each check is its own test.
"""

from __future__ import annotations

import pytest

from tests.fsdp import hsdp_checks
from tests.fsdp.all_checks import failures

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("name", [f.__name__ for f in hsdp_checks.CHECKS])
def test_hsdp(fsdp_results, name):
    assert not failures(fsdp_results, name)
