"""One bounded wait for an asynchronous collective: a time limit, and an error naming what was waited for.

Why: a collective that a peer never issues blocks its waiter for as long as the process group allows and then
fails with a message that names neither the operation nor the caller. Every wait on a ``dist.Work`` in
splitgrad goes through :func:`bounded_wait`, which bounds the wait and turns a timeout or a failure into a
``RuntimeError`` saying what was waited for, on which rank of which group, and for how long.
"""

from __future__ import annotations

import datetime

import torch.distributed as dist

__all__ = ["bounded_wait"]


def bounded_wait(
    work: dist.Work,
    what: str,
    *,
    timeout: float | datetime.timedelta | None,
    group: dist.ProcessGroup | None = None,
    hint: str = "",
) -> None:
    """Wait for ``work`` at most ``timeout``; raise a ``RuntimeError`` naming ``what`` when it fails or times out.

    Args:
        work: the handle of an asynchronous collective or point-to-point operation.
        what: the operation, with the peer where one is involved (``"broadcast from rank 0"``); it starts
            the error message, so callers put their own prefix in it (``"DistributedDataParallel: ..."``).
        timeout: seconds or a ``timedelta``; None waits as long as the process group's own timeout.
        group: the operation's process group (None: the default group), for the rank in the message.
        hint: what probably went wrong, appended to the message.

    Raises:
        RuntimeError: ``"{what} did not complete on rank r of n within {timeout} ({cause}); {hint}"``,
            chained to the backend's error (gloo and NCCL report timeouts and dead peers as exceptions; a
            ``wait`` that returns False timed out too).
    """
    limit = datetime.timedelta(seconds=timeout) if isinstance(timeout, (int, float)) else timeout
    try:
        finished = work.wait() if limit is None else work.wait(timeout=limit)
    except Exception as exc:
        raise RuntimeError(_message(what, limit, group, str(exc), hint)) from exc
    if finished is False:
        raise RuntimeError(_message(what, limit, group, "timed out", hint))


def _message(
    what: str, limit: datetime.timedelta | None, group: dist.ProcessGroup | None, cause: str, hint: str
) -> str:
    within = "the process group's timeout" if limit is None else f"{limit.total_seconds():g} s"
    return (
        f"{what} did not complete on {_where(group)} within {within} ({cause}){f'; {hint}' if hint else ''}"
    )


def _where(group: dist.ProcessGroup | None) -> str:
    """``"rank r of n"`` in ``group``; only ``"this rank"`` once the group can no longer be asked."""
    try:
        return f"rank {dist.get_rank(group)} of {dist.get_world_size(group)}"
    except (RuntimeError, ValueError, KeyError):
        return "this rank"
