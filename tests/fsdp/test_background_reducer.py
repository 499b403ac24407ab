"""The background reducer behind ``defer_fsdp_reduction(mode="async")``, without processes.

Why: its guarantees are what keep the background reduce-scatters exact and hang-free: one worker, first in
first out (the collectives pair up across ranks only if every rank runs them in submission order), a failure
or a stuck reduction surfaces at ``wait()`` as a ``RuntimeError`` naming it, and nothing is lost on a timeout.
"""

from __future__ import annotations

import threading

import pytest

from splitgrad.parallel.fsdp.background import BackgroundReducer


def test_runs_in_submission_order_and_records_each():
    reducer = BackgroundReducer("t", timeout=60)
    gate, ran = threading.Event(), []
    reducer.submit("first", lambda: (gate.wait(60), ran.append("first")))
    for name in ("second", "third"):
        reducer.submit(name, lambda name=name: ran.append(name))
    assert reducer.pending == 3 and ran == []  # the first blocks the worker; nothing overtakes it
    gate.set()
    reducer.wait()
    assert ran == ["first", "second", "third"] and reducer.pending == 0
    assert [label for label, _, _ in reducer.events] == ran
    assert all(start <= end for _, start, end in reducer.events)
    assert ran != ["second", "first", "third"]  # the comparison can fail
    reducer.close()


def test_failure_and_timeout_are_named_and_nothing_is_dropped():
    reducer = BackgroundReducer("defer_fsdp_reduction(M)", timeout=0.2)

    def broken() -> None:
        raise ValueError("boom")

    reducer.submit("reduce-scatter 1", broken)
    reducer.submit("reduce-scatter 1b", lambda: None)
    with pytest.raises(
        RuntimeError, match=r"defer_fsdp_reduction\(M\): background reduce-scatter 1 failed: boom"
    ):
        reducer.wait()
    assert reducer.pending == 1  # the one after the failure is still joined later
    reducer.wait()
    gate, done = threading.Event(), []
    reducer.submit("reduce-scatter 2", lambda: (gate.wait(60), done.append(True)))
    with pytest.raises(RuntimeError, match=r"reduce-scatter 2 did not finish within 0\.2 s"):
        reducer.wait()
    assert reducer.pending == 1  # still owed: the next wait joins it
    gate.set()
    reducer.timeout = 60.0
    reducer.wait()
    assert done == [True] and reducer.pending == 0
    reducer.close()
    with pytest.raises(ValueError, match="timeout must be positive"):
        BackgroundReducer("x", timeout=0)
