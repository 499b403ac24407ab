"""splitgrad.parallel.DistributedDataParallel on 2 and 3 local gloo ranks.

Why: with deferred wgrad, autograd's AccumulateGrad runs before a weight gradient exists, so a DDP driven by it
reduces nothing or garbage. These checks prove the wgrad-hook-driven DDP leaves exactly the float64
full-batch average (and torch DDP's bits) in every ``main_grad``, whatever the order gradients arrive in:
delayed/immediate, fused/unfused, tied modules, no_sync microbatches with zero-bubble W order, buckets
completing out of layout order and differently on each rank, reduce-scatter; and that misuse (unused or
pending gradients, late contributions, a peer that never issues its collective) is a clear error, not a
wrong answer or a hang.

All checks of one world size run in one spawn (process start-up and torch import cost seconds); each is
reported as its own test.
"""

from __future__ import annotations

import pytest

from splitgrad.testing import spawn
from tests.parallel import ddp_checks

pytestmark = pytest.mark.distributed

WORLD2 = [f.__name__ for f in ddp_checks.ALL_WORLDS + ddp_checks.WORLD2_ONLY]
WORLD3 = [f.__name__ for f in ddp_checks.ALL_WORLDS]


@pytest.fixture(scope="module")
def results() -> dict[int, list[dict[str, str | None]]]:
    return {
        2: spawn(ddp_checks.run_checks, 2, WORLD2, timeout=240, pg_timeout=30),
        3: spawn(ddp_checks.run_checks, 3, WORLD3, timeout=240, pg_timeout=30),
    }


def _assert_passed(per_rank: list[dict[str, str | None]], name: str) -> None:
    failures = [
        f"--- rank {rank} ---\n{res[name]}" for rank, res in enumerate(per_rank) if res[name] is not None
    ]
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("name", WORLD2)
def test_two_ranks(results, name):
    _assert_passed(results[2], name)


@pytest.mark.parametrize("name", WORLD3)
def test_three_ranks(results, name):
    _assert_passed(results[3], name)
