"""The spawn harness (splitgrad.distributed.launch.spawn, re-exported as splitgrad.testing.spawn) reports results, failures and hangs faithfully.

Why: every distributed test (DDP now, the pipeline runtime later) trusts it; a harness that swallowed a
rank's exception or hung on a stuck rank would turn real failures into green or into a frozen CI.
"""

from __future__ import annotations

import os
import re
import time

import pytest
import torch

from splitgrad.testing import SpawnError, SpawnTimeoutError, spawn
from tests.parallel import spawn_targets

pytestmark = pytest.mark.distributed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A killed child may linger as a zombie until reaped; treat "zombie" as dead.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


def test_results_come_back_in_rank_order():
    out = spawn(spawn_targets.all_reduce_ranks, 2)
    assert [o["rank"] for o in out] == [0, 1]
    assert [o["sum"] for o in out] == [1.0, 1.0]
    torch.testing.assert_close(out[1]["tensor"], torch.arange(3), rtol=0, atol=0)


def test_failure_names_rank_and_kills_stuck_ranks(tmp_path):
    start = time.monotonic()
    with pytest.raises(SpawnError) as info:
        spawn(spawn_targets.fail_hang_or_return, 3, str(tmp_path), backend=None, timeout=90, grace=1.0)
    elapsed = time.monotonic() - start
    err = info.value
    assert not isinstance(err, SpawnTimeoutError)
    assert [f.rank for f in err.failures] == [1]
    assert err.failures[0].exc_type == "builtins.ValueError"
    assert "rank 1 failed first with builtins.ValueError: boom from rank 1 of 3" in str(err)
    assert "fail_hang_or_return" in err.failures[0].traceback
    # The stuck rank is named as killed (rank 0, which returns at once, may also miss the 1 s grace under load).
    assert re.search(r"rank\(s\) \[(0, )?2\] still running were killed", str(err)), str(err)
    assert elapsed < 60, f"harness waited {elapsed:.0f} s instead of killing the stuck rank"
    pid = int((tmp_path / "rank2.pid").read_text())
    assert not _alive(pid), "the hanging rank survived"


def test_timeout_kills_and_names_ranks():
    start = time.monotonic()
    with pytest.raises(SpawnTimeoutError) as info:
        spawn(spawn_targets.hang, 1, backend=None, timeout=6)
    assert info.value.stuck == [0]
    assert "did not finish within 6 s" in str(info.value)
    assert time.monotonic() - start < 30
