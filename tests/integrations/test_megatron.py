"""splitgrad layers inside Megatron-Core (the real ``megatron-core`` package, pinned in requirements-frameworks.txt).

Why: Megatron-Core's ``DistributedDataParallel`` is what most users wrap TE-style layers in. Its hook asserts a
``.grad`` under ``overlap_grad_reduce=True`` and skips its own add when ``grad_added_to_main_grad``, so a fused
layer must follow TE's dummy-wgrad convention; and its interleaved pipeline order is the reference
``interleaved-1f1b`` claims to reproduce. Both are checked against Megatron's own code, not a copy of it.
"""

from __future__ import annotations

import pytest

from splitgrad.integrations.megatron import interleaved_orders, interleaved_schedule, schedule_from_orders
from splitgrad.pipeline import build_schedule, validate
from splitgrad.testing import spawn
from tests.helpers import rank_failures

from . import megatron_checks

pytestmark = pytest.mark.filterwarnings("ignore:Transformer Engine and Apex are not installed")


@pytest.fixture(scope="module")
def results() -> list[dict[str, str | None]]:
    return spawn(megatron_checks.run_checks, 2, megatron_checks.ALL, timeout=300, pg_timeout=60)


@pytest.mark.distributed
@pytest.mark.parametrize("name", megatron_checks.ALL)
def test_megatron_ddp(results, name):
    failures = rank_failures(results, name)
    assert not failures, failures


@pytest.mark.parametrize("p", [2, 4, 8])
@pytest.mark.parametrize("v", [2, 3, 4])
@pytest.mark.parametrize("mult", [1, 2, 4])
def test_interleaved_1f1b_is_megatrons_order(p, v, mult):
    """Megatron's per-rank order (get_schedule_table + convert_schedule_table_to_order, warm-up from
    get_pp_rank_microbatches), translated action for action, equals splitgrad's ``interleaved-1f1b``."""
    m = mult * p
    ours = build_schedule("interleaved-1f1b", p * v, m, stages_per_rank=v)
    megatron = interleaved_schedule(p, v, m)
    validate(megatron)
    assert megatron.stage_to_rank == ours.stage_to_rank
    for rank, (got, want) in enumerate(zip(megatron.rank_actions, ours.rank_actions, strict=True)):
        assert got == want, (
            f"p={p} v={v} m={m} rank {rank}: {[a.name for a in got]} != {[a.name for a in want]}"
        )


def test_translation_refuses_a_wrong_order():
    """Not trivially passing: the translation checks each entry against Megatron's table, and an order that
    moves one backward past a forward (still consistent with the table) is not splitgrad's."""
    table, orders = interleaved_orders(2, 2, 4)
    bad = [list(o) for o in orders]
    bad[0][0] = -bad[0][0]  # a backward where Megatron runs a forward
    with pytest.raises(ValueError, match="rank 0"):
        schedule_from_orders(table, bad, 4, 2)
    order = list(orders[1])
    i = next(
        i for i in range(len(order) - 1) if order[i] > 0 and order[i + 1] > 0 and order[i] != order[i + 1]
    )
    order[i], order[i + 1] = order[i + 1], order[i]  # two forwards of different chunks trade places
    with pytest.raises(ValueError, match="rank 1"):
        schedule_from_orders(table, [orders[0], order], 4, 2)
    order = list(orders[1])
    i = next(i for i in range(len(order) - 1) if order[i] > 0 > order[i + 1])
    order[i], order[i + 1] = order[i + 1], order[i]  # a backward one step earlier
    other = schedule_from_orders(table, [orders[0], order], 4, 2)
    assert other.rank_actions[1] != build_schedule("interleaved-1f1b", 4, 4).rank_actions[1]
