"""pp=2 x tp=2 (4 gloo ranks): the pipeline runtime runs a tensor-parallel GPT with deferred wgrad; and
tp=2 x dp=2: splitgrad's DistributedDataParallel over the TP shards' outer group.

Why: the TP layers communicate inside forward, backward and W; the pipeline moves activations between stages
on another group and runs W at its own time ("zb-h1 sp": with sequence parallelism, the activations between
the stages being this rank's sequence shard). Every TP pair must issue the same collectives in the same order
and every gradient shard must match the float64 tp=1 single-process reference (tolerance only: the sharded
GEMMs and the all-reduces sum in a different order).
"""

from __future__ import annotations

import pytest

from splitgrad.testing import spawn
from tests.tensor_parallel.pp_tp_worker import pp_tp_worker

pytestmark = pytest.mark.distributed

SCHEDULES = ["1f1b", "zb-h1", "zb-h1 sp"]


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return spawn(pp_tp_worker, 4, SCHEDULES, timeout=400, pg_timeout=120)


@pytest.mark.parametrize("schedule", [*SCHEDULES, "tp2xdp2 ddp", "tp2xdp2 ddp sp"])
def test_pp2_tp2_matches_tp1(results, schedule):
    for rank, res in enumerate(results):
        r = res[schedule]
        assert r["checked"] > 0 and not r["bad"], f"rank {rank} {schedule}: gradients differ for {r['bad']}"
        assert abs(r["loss"] - r["ref_loss"]) <= 1e-10, f"rank {rank} {schedule}: {r}"
    if schedule.startswith("zb-h1"):  # W actions ran deferred work on every rank
        assert all(res[schedule]["w_tasks"] > 0 for res in results), [r[schedule]["w_tasks"] for r in results]
    if schedule == "zb-h1 sp":  # every stage holds sequence-parallel norms / row biases and reduced them
        reduced = [res[f"{schedule}:reduced"] for res in results]
        assert all(n > 0 for n in reduced), reduced
    if schedule == "tp2xdp2 ddp sp":  # 2 blocks x (2 norms x (weight, bias) + proj.bias + fc2_bias)
        reduced = [res[schedule]["reduced"] for res in results]
        assert reduced == [12] * 4, reduced
