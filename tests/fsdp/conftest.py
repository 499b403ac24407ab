"""The one spawn every FSDP2 test module reads its results from (see tests/fsdp/all_checks.py)."""

from __future__ import annotations

import pytest

from splitgrad.testing import spawn
from tests.fsdp import all_checks


@pytest.fixture(scope="package")
def fsdp_results() -> list[dict[str, str | None]]:
    return spawn(all_checks.run_checks, all_checks.WORLD, all_checks.NAMES, timeout=600, pg_timeout=180)
