"""Token exchange for expert parallelism: split sizes first, then ``all_to_all_single`` with autograd.

Dispatch sends each rank's token copies, sorted by expert (hence by owning rank), to the ranks that own those
experts; combine sends the expert outputs back. Both are the same collective with the split sizes swapped, and
the backward of one is the other: :class:`AllToAll` is that autograd Function. The variable split sizes must be
known to every receiver before the tokens move, so :func:`start_count_exchange` all-to-alls the per-expert token
counts first (a tiny int64 exchange; the one host sync of a dispatch).

Every collective is issued asynchronously and waited through :func:`~splitgrad.distributed.wait.bounded_wait`
(the group's own timeout by default), so a rank that never joins raises a ``RuntimeError`` naming the operation
instead of hanging silently.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Generator

import torch
import torch.distributed as dist

from ...distributed.group_ref import GroupRef
from ...distributed.wait import bounded_wait

__all__ = [
    "AllToAll",
    "CountExchange",
    "PendingExchange",
    "await_exchange",
    "finish_all_to_all",
    "start_all_to_all",
    "start_count_exchange",
    "wait_work",
]

logger = logging.getLogger(__name__)


def wait_work(
    work: dist.Work,
    what: str,
    group: dist.ProcessGroup,
    timeout: float | None = None,
    wait_log: list | None = None,
) -> None:
    """Wait for ``work``; raise a ``RuntimeError`` naming ``what`` and this rank when it fails or times out.

    Args:
        work: an async collective's handle.
        what: the operation, for the error message.
        group: its process group (for the rank in the message).
        timeout: seconds; None waits as long as the group's own timeout.
        wait_log: when given, appends ``(what, start, end)`` of the wait itself (``time.perf_counter()``
            seconds): the time this thread was blocked, not the time the collective was in flight.
    """
    start = time.perf_counter()
    try:
        bounded_wait(
            work,
            f"expert parallel {what}",
            timeout=timeout,
            group=group,
            hint="did every rank of the expert-parallel group run the same MoE layers in the same order?",
        )
    finally:
        if wait_log is not None:
            wait_log.append((what, start, time.perf_counter()))


class CountExchange:
    """A token-count exchange in flight (from :func:`start_count_exchange`); :meth:`wait` returns its result.

    Starting it before the token permutation and waiting just before the dispatch lets the round trip run
    under that compute instead of as a separate blocking step.
    """

    def __init__(
        self,
        received: torch.Tensor,
        work: dist.Work,
        group: dist.ProcessGroup,
        log: list | None,
        wait_log: list | None = None,
    ) -> None:
        self._received, self._work, self._group, self._log = received, work, group, log
        self._wait_log = wait_log

    def wait(self, timeout: float | None = None) -> torch.Tensor:
        """Wait for the exchange; return ``(ep_size, local_experts)`` int64 on the host: row ``s`` holds how
        many copies rank ``s`` sends to each of this rank's experts."""
        start = time.perf_counter()
        wait_work(self._work, "token-count exchange", self._group, timeout, self._wait_log)
        if (
            self._log is not None
        ):  # (name, wait start, end): only the blocked part (the permutation ran before)
            self._log.append(("dispatch counts", start, time.perf_counter()))
        return self._received.view(dist.get_world_size(self._group), -1).cpu()


def start_count_exchange(
    counts: torch.Tensor,
    group: dist.ProcessGroup,
    log: list | None = None,
    wait_log: list | None = None,
) -> CountExchange:
    """All-to-all the per-expert token counts of an expert-parallel group, asynchronously.

    Args:
        counts: ``(ep_size * local_experts,)`` int64: how many token copies this rank sends to each global
            expert (experts ``[r * local_experts, (r + 1) * local_experts)`` live on rank ``r``).
        group: the expert-parallel group.
        log: when given, the wait appends ``("dispatch counts", start, end)`` (``time.perf_counter()`` seconds,
            from entering the wait).
        wait_log: see :func:`wait_work`.

    Returns:
        The exchange in flight; its ``wait()`` returns the received counts.

    Raises:
        ValueError: ``counts`` is not ``(ep_size * local_experts,)``.
    """
    ep = dist.get_world_size(group)
    if counts.dim() != 1 or counts.numel() % ep:
        raise ValueError(
            f"start_count_exchange: counts must be (ep_size * local_experts,), got shape {tuple(counts.shape)} for "
            f"ep_size={ep}"
        )
    received = torch.empty_like(counts)
    work = dist.all_to_all_single(received, counts.contiguous(), group=group, async_op=True)
    return CountExchange(received, work, group, log, wait_log)


class PendingExchange:
    """A forward token exchange in flight (from :func:`start_all_to_all`); :func:`finish_all_to_all` waits for it
    and makes it differentiable.

    ``out``: the receive buffer ``(sum(out_splits), *rest)``, valid once waited; ``start``: when it was issued
    (``time.perf_counter()`` seconds).
    """

    def __init__(
        self,
        out: torch.Tensor,
        sent: torch.Tensor,
        work: dist.Work,
        splits: tuple[list[int], list[int]],
        group: dist.ProcessGroup,
        what: str,
        log: list | None,
        wait_log: list | None = None,
    ) -> None:
        self.out, self._sent, self._work, self.splits = out, sent, work, splits
        self.group, self.what, self.log, self.wait_log = group, what, log, wait_log
        self.start = time.perf_counter()
        self.done = False

    def wait(self) -> torch.Tensor:
        """Wait for the exchange (once) and log it; returns ``out``."""
        if not self.done:
            self.done = True
            wait_work(self._work, self.what, self.group, wait_log=self.wait_log)
            self._sent = None  # the send buffer must live until the exchange completed
            if self.log is not None:  # (name, issued, waited) in perf_counter seconds, for timelines
                self.log.append((self.what, self.start, time.perf_counter()))
        return self.out

    def settle(self) -> None:
        """Wait for the exchange if nobody did, swallowing its error: a driver abandoning the forward (the other
        part raised) must not leave a collective unwaited (it would hang the group's later collectives)."""
        try:
            self.wait()
        except RuntimeError as exc:
            logger.debug("abandoned %s failed too: %s", self.what, exc)


def start_all_to_all(
    x: torch.Tensor,
    out_splits: list[int],
    in_splits: list[int],
    group: dist.ProcessGroup,
    *,
    what: str = "all-to-all",
    log: list | None = None,
    wait_log: list | None = None,
) -> PendingExchange:
    """Issue a variable-split exchange over ``group`` (no autograd, no wait).

    Args:
        x: ``(sum(in_splits), *rest)``; row block ``r`` (``in_splits[r]`` rows) goes to rank ``r``. It must stay
            unmodified until :func:`finish_all_to_all`.
        out_splits: rows received from each rank (from the token-count exchange).
        in_splits: rows sent to each rank.
        group: the expert-parallel group.
        what: name of the exchange in error messages and logs (``"dispatch"``, ``"combine"``).
        log: when given, each exchange (forward and backward) appends ``(name, start, end)`` to it
            (``time.perf_counter()`` seconds, wait included).
        wait_log: when given, every wait of this exchange (forward and backward) appends ``(name, start, end)``
            of the blocked time (see :func:`wait_work`).

    Returns:
        The exchange in flight.

    Raises:
        ValueError: the split sizes do not match the group or ``x``.
    """
    ep = dist.get_world_size(group)
    if len(out_splits) != ep or len(in_splits) != ep or sum(in_splits) != x.shape[0]:
        raise ValueError(
            f"all_to_all ({what}): need {ep} split sizes each way with sum(in_splits) == x.shape[0], got "
            f"{in_splits=} {out_splits=} x.shape={tuple(x.shape)}"
        )
    sent = x.detach().contiguous()
    out = sent.new_empty((sum(out_splits), *x.shape[1:]))
    work = dist.all_to_all_single(out, sent, list(out_splits), list(in_splits), group=group, async_op=True)
    return PendingExchange(out, sent, work, (list(out_splits), list(in_splits)), group, what, log, wait_log)


def await_exchange(pending: PendingExchange, *also: dist.Work) -> Generator[PendingExchange, None, None]:
    """One step boundary of a ``forward_steps`` generator: yield with ``pending`` in flight.

    Use as ``yield from await_exchange(pending)`` right after issuing it. If the driver abandons the generator
    there (``close()``, or an error thrown in), ``pending`` and the other works ``also`` in flight are waited
    first, so no collective is left unwaited.
    """
    try:
        yield pending
    except BaseException:
        pending.settle()
        for work in also:
            try:
                work.wait()
            except RuntimeError as exc:
                logger.debug("abandoned collective failed too: %s", exc)
        raise


def _exchange(
    x: torch.Tensor,
    out_splits: list[int],
    in_splits: list[int],
    group: dist.ProcessGroup,
    what: str,
    log: list | None = None,
    while_in_flight: Callable[[], object] | None = None,
    wait_log: list | None = None,
) -> torch.Tensor:
    start = time.perf_counter()
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    work = dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group, async_op=True)
    try:
        if while_in_flight is not None:
            while_in_flight()
    finally:
        # Waited even when the work in flight failed: a collective left unwaited would hang the group.
        wait_work(work, what, group, wait_log=wait_log)
    if log is not None:  # (name, start, end) in perf_counter seconds, for timelines
        log.append((what, start, time.perf_counter()))
    return out


class AllToAll(torch.autograd.Function):
    """The finishing half of a variable-split ``all_to_all_single``; backward runs the same exchange the other way.

    Shapes: ``x: (sum(in_splits), *rest)`` -> ``(sum(out_splits), *rest)``; row block ``s`` of the output
    came from rank ``s`` of the group. The forward waits for ``pending`` (started by :func:`start_all_to_all`
    from ``x``) and returns its buffer; the backward exchanges the gradient over the same group.
    ``in_backward_flight`` (optional) is called while the backward exchange is in flight, before its wait; so
    is the node's ``advance_pair`` attribute when the overlapped driver set it (it advances the other
    microbatch's forward by one step).
    """

    @staticmethod
    def forward(ctx, x, pending, in_backward_flight):  # type: ignore[override]
        # The group is looked up / held weakly (distributed/group_ref.py): a graph kept alive by a tensor in the
        # user's globals must not keep the group's gloo workers alive past destroy_process_group().
        ctx.group = GroupRef(pending.group, owner=f"AllToAll ({pending.what}) group")
        ctx.splits, ctx.what, ctx.log = pending.splits, pending.what, pending.log
        ctx.wait_log = pending.wait_log
        ctx.in_flight = in_backward_flight
        ctx.advance_pair = None
        return pending.wait()

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        out_splits, in_splits = ctx.splits
        in_flight, advance = ctx.in_flight, ctx.advance_pair

        def while_in_flight() -> None:
            if in_flight is not None:
                in_flight()
            if advance is not None:
                advance()

        dx = _exchange(
            grad,
            in_splits,
            out_splits,
            ctx.group.get(),
            f"{ctx.what} backward",
            ctx.log,
            while_in_flight if in_flight is not None or advance is not None else None,
            ctx.wait_log,
        )
        return dx, None, None


def finish_all_to_all(
    x: torch.Tensor,
    pending: PendingExchange,
    *,
    in_backward_flight: Callable[[], object] | None = None,
) -> torch.Tensor:
    """Wait for ``pending`` (started from ``x``) and return its output, differentiable with respect to ``x``.

    Args:
        x: the tensor :func:`start_all_to_all` sent.
        pending: its exchange in flight.
        in_backward_flight: called in the backward after the backward exchange started and before it is
            waited for (work independent of it, e.g. the experts' deferred weight gradients); None: nothing.

    Returns:
        ``(sum(out_splits), *rest)``.
    """
    return AllToAll.apply(x, pending, in_backward_flight)
