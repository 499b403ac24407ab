"""PyTorch's schedule CSVs run by splitgrad's runtime on 2 gloo ranks, against the float64 reference.

Why: loading a CSV (``Schedule.from_csv``) is only useful if the loaded schedule trains the model exactly.
torch 2.13's ``ScheduleInterleavedZeroBubble`` (loop placement, idle cells), ``ScheduleZBVZeroBubble`` (V
placement) and ``ScheduleDualPipeV`` (V placement, overlapped ``OVERLAP_F_B`` pairs with full backwards)
are dumped to CSV by torch, loaded, validated, simulated and run in one spawn.
"""

from __future__ import annotations

import pytest

from splitgrad.testing import spawn
from tests.pipeline import torch_csv_worker


@pytest.fixture(scope="module")
def results():
    return spawn(torch_csv_worker.run_csv_schedules, 2, timeout=300)


@pytest.mark.distributed
@pytest.mark.parametrize("name", [c.__name__ for c in torch_csv_worker.CLASSES])
def test_torch_csv_runs_exactly(results, name):
    for rank, res in enumerate(results):
        out = res[name]
        assert out["checked"] > 0, f"rank {rank} checked no parameter"
        assert not out["bad"], f"rank {rank} {name}: {out['bad']}"
        assert out["loss"] == pytest.approx(out["ref_loss"], rel=1e-12)
        assert out["w_tasks"] > 0, f"rank {rank} ran no deferred weight gradient"


@pytest.mark.distributed
def test_a_wrong_reference_is_rejected(results):
    assert all(res["ScheduleDualPipeV"]["other_data_bad"] > 0 for res in results)
