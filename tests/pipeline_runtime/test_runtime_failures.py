"""A pipeline peer that crashes or stalls mid-step produces errors naming the rank and the action, never a hang.

Why: a point-to-point wait with no bound turns one bad rank into a silent, job-wide hang. Each case runs
1F1B on 2 gloo ranks with a bounded runtime wait (2 s; 8 s for the stall, so that on a loaded machine the stalled
rank has reached its stall before its peer gives up); the spawn harness's own deadline (60 s) is far away, so
reaching it (a :class:`SpawnTimeoutError` with no failure reported) would mean the runtime hung.
"""

from __future__ import annotations

import re

import pytest

from splitgrad.testing import SpawnError, SpawnTimeoutError, spawn

from . import workers


def _failures(mode: str, failing_rank: int, wait_s: float = 2.0) -> dict[int, str]:
    with pytest.raises(SpawnError) as info:
        spawn(workers.failure_worker, 2, mode, failing_rank, wait_s, timeout=60)
    err = info.value
    assert not (isinstance(err, SpawnTimeoutError) and not err.failures), f"the ranks hung: {err}"
    return {f.rank: f"{f.exc_type}: {f.message}" for f in err.failures}


def test_peer_raising_is_named_by_the_waiting_rank():
    failures = _failures("raise", failing_rank=0)
    assert "injected failure" in failures[0]
    # Rank 0's second forward raised: rank 1 waits for microbatch 1's activation, or still for microbatch 0's
    # when rank 0 exited before its already-posted send was delivered.
    assert 1 in failures, f"the surviving rank reported nothing: {failures}"
    assert "pipeline rank 1" in failures[1] and "from rank 0" in failures[1], failures[1]
    assert re.search(r"action 1F[01]\b", failures[1]), failures[1]


def test_stalled_peer_times_out_with_the_action():
    failures = _failures("stall", failing_rank=1, wait_s=8.0)
    # Rank 1 sleeps in its second forward; rank 0 runs F0 F1 B0 and then waits for B1's gradient (or, on a
    # loaded machine where rank 1 is over 8 s behind from the start, already for B0's, whose channel may not
    # have sent its shape header yet: "the header of the gradient ... (before action 0BW0) from rank 1").
    assert 0 in failures, failures
    assert "within 8 s" in failures[0], failures[0]
    assert re.search(r"action 0BW[01]\)? from rank 1", failures[0]), failures[0]
    assert 1 not in failures, "the stalled rank should have been killed, not report"
