"""``bounded_wait``: the one wait every collective of the library goes through, without processes.

Why: a peer that never issues its collective must turn into an error that names the operation, the rank and
the limit, never a silent hang or a bare backend message. Stand-in ``Work`` objects play the three outcomes a
backend reports: done, an exception (gloo and NCCL report timeouts and dead peers so), and ``False`` (a wait
that timed out without raising).
"""

from __future__ import annotations

import datetime

import pytest

from splitgrad.distributed.wait import bounded_wait


class _Work:
    def __init__(self, outcome: object) -> None:
        self.outcome, self.timeouts = outcome, []

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        self.timeouts.append(timeout)
        if isinstance(self.outcome, BaseException):
            raise self.outcome
        return self.outcome


def test_a_finished_work_passes_with_the_limit_as_a_timedelta():
    work = _Work(True)
    bounded_wait(work, "all-reduce", timeout=2.5)
    bounded_wait(work, "all-reduce", timeout=None)  # the process group's own limit: no argument
    assert work.timeouts == [datetime.timedelta(seconds=2.5), None]


def test_a_failure_names_the_operation_the_rank_the_limit_and_the_cause():
    cause = RuntimeError("Connection closed by peer")
    with pytest.raises(RuntimeError) as info:
        bounded_wait(
            _Work(cause), "DDP: bucket 3", timeout=datetime.timedelta(seconds=5), hint="did a peer crash?"
        )
    message = str(info.value)
    assert message.startswith("DDP: bucket 3 did not complete on ")
    assert "within 5 s (Connection closed by peer); did a peer crash?" in message
    assert info.value.__cause__ is cause


def test_a_wait_returning_false_is_a_timeout_too():
    with pytest.raises(RuntimeError, match=r"^broadcast from rank 0 did not complete .* within the process "):
        bounded_wait(_Work(False), "broadcast from rank 0", timeout=None)
    # Not trivially passing: only False is a timeout; a backend returning None (no verdict) has finished.
    bounded_wait(_Work(None), "broadcast from rank 0", timeout=1.0)
