"""Point-to-point transport of a pipeline runtime: activations forward, input gradients backward.

One :class:`PipelineComm` per rank carries every cross-rank :class:`~splitgrad.pipeline.actions.Transfer` of a
:class:`~splitgrad.pipeline.Schedule` over ``torch.distributed`` (``batch_isend_irecv``: gloo on CPU, NCCL on
accelerators). Rules, all derived from the schedule so both ends agree without talking:

* **Order.** A receiver posts its receives from a peer in the order that peer *sends* (its action order),
  buffering messages it does not need yet. Transports that pair messages by posting order (NCCL) therefore
  never match an activation with a same-shaped gradient, whatever order the receiver consumes them in.
* **Shapes.** The first message of each channel ``(kind, src_stage)`` in a step is preceded by a small int64
  header ``[ndim, dtype code, *shape]``; the receiver allocates from it. Later microbatches of the step must
  have the same shape and dtype on that channel (checked on the sending side, naming the action).
* **Batching.** Sends are queued after an action and posted together with the next receive in one
  ``batch_isend_irecv`` call (one NCCL group: the "send forward, receive backward" pairing of 1F1B), or
  flushed before the next compute when no receive comes first. Sends are waited at the end of the step.
* **Bounded waits.** Every wait uses ``work.wait(timeout)``; a timeout or a dead peer becomes a
  ``RuntimeError`` naming this rank, the peer, the message and the action it was for.
"""

from __future__ import annotations

import datetime
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .actions import Action, Schedule, Transfer

__all__ = ["PipelineComm"]

logger = logging.getLogger(__name__)

#: dtypes a header can name (its code is the index); append only, never reorder.
DTYPES: tuple[torch.dtype, ...] = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
)
MAX_NDIM = 8
HEADER_LEN = 2 + MAX_NDIM

MessageKey = tuple[str, int, int]
"""``(kind, src_stage, microbatch)`` identifies one message within a step."""


def message_key(transfer: Transfer) -> MessageKey:
    return (transfer.kind, transfer.src_stage, transfer.microbatch)


def describe(transfer: Transfer) -> str:
    """``"activation of stage 0 -> 1, microbatch 3"``."""
    return f"{transfer.kind} of stage {transfer.src_stage} -> {transfer.dst_stage}, microbatch {transfer.microbatch}"


def encode_header(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    if tensor.dim() > MAX_NDIM or tensor.dtype not in DTYPES:
        raise ValueError(
            f"pipeline messages support up to {MAX_NDIM} dims and dtypes {DTYPES}; got "
            f"shape {tuple(tensor.shape)} dtype {tensor.dtype}"
        )
    values = [tensor.dim(), DTYPES.index(tensor.dtype), *tensor.shape]
    values += [0] * (HEADER_LEN - len(values))
    return torch.tensor(values, dtype=torch.int64, device=device)


def decode_header(header: torch.Tensor) -> tuple[tuple[int, ...], torch.dtype]:
    values = header.tolist()
    ndim, code = int(values[0]), int(values[1])
    if not (0 <= ndim <= MAX_NDIM and 0 <= code < len(DTYPES)):
        raise RuntimeError(f"corrupt pipeline message header {values} (peers running different versions?)")
    return tuple(int(v) for v in values[2 : 2 + ndim]), DTYPES[code]


@dataclass(slots=True)
class _Incoming:
    """Receive state of one message: header (if it carries one), then payload."""

    transfer: Transfer
    carries_header: bool
    header: torch.Tensor | None = None
    header_work: dist.Work | None = None
    payload: torch.Tensor | None = None
    payload_work: dist.Work | None = None
    consumed: bool = False


@dataclass(slots=True)
class _StepState:
    """Per-step bookkeeping: negotiated shapes, messages being received, sends queued or in flight."""

    meta_out: dict[tuple[str, int], tuple[tuple[int, ...], torch.dtype]] = field(default_factory=dict)
    meta_in: dict[tuple[str, int], tuple[tuple[int, ...], torch.dtype]] = field(default_factory=dict)
    incoming: dict[MessageKey, _Incoming] = field(default_factory=dict)
    next_index: dict[int, int] = field(default_factory=dict)
    queued: list[dist.P2POp] = field(default_factory=list)
    queued_about: list[tuple[Transfer, Action]] = field(default_factory=list)
    sent: list[tuple[list[dist.Work], list[torch.Tensor], list[tuple[Transfer, Action]]]] = field(
        default_factory=list
    )


class PipelineComm:
    """Sends and receives one rank's messages of a schedule (see the module docstring for the rules).

    Args:
        schedule: the schedule every rank runs.
        rank: this rank's index in the schedule (its rank in ``group``).
        group: the pipeline process group (None: the default group).
        device: where receive buffers and headers live (CPU for gloo, the accelerator for NCCL).
        timeout: seconds any single wait may take before raising.
        prefetch: post the next action's receive before running the current one (overlaps transfer and
            compute). Safe with gloo, whose receives never block sends; keep it off for NCCL, where a receive
            posted ahead of a send on the same pair stream can deadlock.
        on_wait: ``on_wait(label, start, end)`` called after each blocking receive (timeline recording).
    """

    def __init__(
        self,
        schedule: Schedule,
        rank: int,
        *,
        group: dist.ProcessGroup | None,
        device: torch.device,
        timeout: float,
        prefetch: bool = False,
        on_wait: Callable[[str, float, float], None] | None = None,
    ) -> None:
        self.schedule = schedule
        self.rank = rank
        self.group = group
        self.device = device
        self.timeout = float(timeout)
        self.prefetch_enabled = prefetch
        self._on_wait = on_wait
        self._global = {r: self._global_rank(r) for r in range(schedule.n_ranks)}
        # Messages from each peer in that peer's send order, and which of them open a channel (carry a header).
        self._from_peer: dict[int, list[tuple[Transfer, bool]]] = {}
        self._first_out: set[MessageKey] = set()
        self._position: dict[MessageKey, tuple[int, int]] = {}
        for src, actions in enumerate(schedule.rank_actions):
            opened: set[tuple[int, str, int]] = set()
            for out in (t for action in actions for t in schedule.sends(action)):
                channel = (out.dst_rank, out.kind, out.src_stage)
                first = channel not in opened
                opened.add(channel)
                if src == rank and first:
                    self._first_out.add(message_key(out))
                if out.dst_rank == rank:
                    msgs = self._from_peer.setdefault(src, [])
                    self._position[message_key(out)] = (src, len(msgs))
                    msgs.append((out, first))
        self._tag_base = 2 * schedule.n_stages
        self._state = _StepState()

    def _rank_of(self, global_rank: int) -> int:
        return next((r for r, g in self._global.items() if g == global_rank), global_rank)

    def _global_rank(self, r: int) -> int:
        if self.group is None or self.group is dist.GroupMember.WORLD:
            return r
        return dist.get_global_rank(self.group, r)

    def _tag(self, transfer: Transfer, header: bool) -> int:
        channel = 2 * transfer.src_stage + (transfer.kind == "gradient")
        return 2 * (transfer.microbatch * self._tag_base + channel) + header

    # -- step boundaries ---------------------------------------------------------------------------------

    def begin_step(self) -> None:
        """Forget the previous step's shapes and buffers."""
        self._state = _StepState()

    def finish_step(self) -> None:
        """Post queued sends, wait for every send of the step, and check every expected message arrived."""
        self.flush()
        state = self._state
        deadline = time.monotonic() + self.timeout
        for works, _tensors, about in state.sent:
            self._wait_sent(works, about, deadline)
        received = sum(state.next_index.values())
        expected = sum(len(msgs) for msgs in self._from_peer.values())
        unread = [describe(m.transfer) for m in state.incoming.values() if not m.consumed]
        self._state = _StepState()
        if unread or received != expected:
            raise RuntimeError(
                f"pipeline rank {self.rank}: the step ended with {expected - received} of {expected} messages never "
                f"received and these received but never used: {unread}; the schedule and the runtime disagree"
            )

    def abort(self) -> None:
        """Drop all per-step state after an error (outstanding works are abandoned, not waited)."""
        self._state = _StepState()

    # -- sending -----------------------------------------------------------------------------------------

    def queue_send(self, transfer: Transfer, tensor: torch.Tensor, action: Action) -> None:
        """Queue ``tensor`` (any shape) as ``transfer``; it is posted at the next receive or :meth:`flush`."""
        state = self._state
        payload = tensor.detach().contiguous()
        channel = (transfer.kind, transfer.src_stage)
        meta = (tuple(payload.shape), payload.dtype)
        peer = self._global[transfer.dst_rank]
        if message_key(transfer) in self._first_out:
            state.meta_out[channel] = meta
            header = encode_header(payload, self.device)
            state.queued.append(dist.P2POp(dist.isend, header, peer, self.group, self._tag(transfer, True)))
            state.queued_about.append((transfer, action))
        elif state.meta_out.get(channel) != meta:
            raise ValueError(
                f"pipeline rank {self.rank}: action {action} sends the {describe(transfer)} with shape {meta[0]} "
                f"dtype {meta[1]}, but this step already announced {state.meta_out.get(channel)} on that channel; "
                "every microbatch of a step must have the same shapes"
            )
        state.queued.append(dist.P2POp(dist.isend, payload, peer, self.group, self._tag(transfer, False)))
        state.queued_about.append((transfer, action))

    def _wait_sent(
        self, works: list[dist.Work], about: list[tuple[Transfer, Action]], deadline: float
    ) -> None:
        for work, (transfer, action) in zip(works, about):
            what = f"rank {transfer.dst_rank} to receive the {describe(transfer)} sent by action {action}"
            self.wait(work, what, deadline=deadline)

    def _release_delivered(self) -> None:
        """Drop finished sends (their tensors would otherwise live until the end of the step)."""
        state, pending = self._state, []
        for entry in state.sent:
            if all(_completed(work) for work in entry[0]):
                self._wait_sent(entry[0], entry[2], time.monotonic() + self.timeout)  # raises a stored error
            else:
                pending.append(entry)
        state.sent = pending

    def flush(self, action: Action | None = None) -> None:
        """Post every queued send now (``action``: the one about to run, named if posting fails)."""
        self._launch([], action)

    def _launch(self, recv_ops: list[dist.P2POp], action: Action | None) -> list[dist.Work]:
        """Post queued sends and ``recv_ops`` in one batch; returns the receives' works."""
        state = self._state
        ops = state.queued + recv_ops
        if not ops:
            return []
        if state.sent:
            self._release_delivered()
        try:
            works = dist.batch_isend_irecv(ops)
        except Exception as exc:
            sends = sorted({str(a) for _, a in state.queued_about})
            peers = sorted(
                {t.dst_rank for t, _ in state.queued_about} | {self._rank_of(op.peer) for op in recv_ops}
            )
            where = f"before action {action}" if action is not None else "at the end of the step"
            ranks = ("ranks " if len(peers) > 1 else "rank ") + ", ".join(map(str, peers))
            raise RuntimeError(
                f"{self._who()}: failed posting, {where}, the messages of actions {sends} and {len(recv_ops)} "
                f"receive(s), to/from {ranks} (did it crash?): {exc}"
            ) from exc
        n_send = len(state.queued)
        if n_send:
            state.sent.append((works[:n_send], [op.tensor for op in state.queued], list(state.queued_about)))
        state.queued, state.queued_about = [], []
        return works[n_send:]

    # -- receiving ---------------------------------------------------------------------------------------

    def prefetch(self, transfer: Transfer, action: Action) -> None:
        """Post receives up to ``transfer`` (needed by ``action``) without blocking; a no-op unless enabled."""
        if self.prefetch_enabled:
            self._advance(transfer, action, block=False)

    def receive(self, transfer: Transfer, action: Action) -> torch.Tensor:
        """Receive ``transfer`` for ``action`` (posting queued sends in the same batch) and return it.

        Returns:
            A fresh tensor with the sender's shape and dtype, on :attr:`device`.
        """
        msg = self._advance(transfer, action, block=True)
        if msg is None or msg.consumed:
            raise RuntimeError(
                f"pipeline rank {self.rank}: action {action} receives the {describe(transfer)} twice"
            )
        label = f"recv {'act' if transfer.kind == 'activation' else 'grad'} {action}"
        what = f"the {describe(transfer)} of action {action} from rank {transfer.src_rank}"
        self.wait(msg.payload_work, what, label=label)
        msg.consumed = True
        payload, msg.payload, msg.payload_work = msg.payload, None, None
        return payload

    def _advance(self, transfer: Transfer, action: Action | None, *, block: bool) -> _Incoming | None:
        """Post (in the sender's order) every receive from ``transfer``'s sender up to and including it.

        A message that opens a channel needs its header before its payload buffer can be allocated: with
        ``block`` the header is waited for; without, posting stops there unless it has already arrived.
        """
        state = self._state
        key = message_key(transfer)
        if key not in self._position:
            raise RuntimeError(
                f"pipeline rank {self.rank}: action {action} expects the {describe(transfer)}, which no rank's "
                "schedule sends"
            )
        peer, target = self._position[key]
        msgs = self._from_peer[peer]
        ops: list[dist.P2POp] = []
        posted: list[tuple[_Incoming, bool]] = []

        def post() -> None:
            for (m, is_header), work in zip(posted, self._launch(ops, action)):
                if is_header:
                    m.header_work = work
                else:
                    m.payload_work = work
            ops.clear()
            posted.clear()

        index = state.next_index.get(peer, 0)
        while index <= target:
            spec, carries_header = msgs[index]
            msg = state.incoming.get(message_key(spec))
            if msg is None:
                msg = state.incoming[message_key(spec)] = _Incoming(spec, carries_header)
            channel = (spec.kind, spec.src_stage)
            if msg.carries_header and channel not in state.meta_in:
                if msg.header is None:
                    msg.header = torch.empty(HEADER_LEN, dtype=torch.int64, device=self.device)
                    ops.append(self._recv_op(msg.header, spec, header=True))
                    posted.append((msg, True))
                # Posts queued sends too: never block while holding a message a peer may be waiting for.
                post()
                if not (block or _completed(msg.header_work)):
                    break
                what = (
                    f"the header of the {describe(spec)} (before action {action}) from rank {spec.src_rank}"
                )
                self.wait(msg.header_work, what, label=f"recv header {action}" if block else None)
                state.meta_in[channel] = decode_header(msg.header)
            shape, dtype = state.meta_in[channel]
            msg.payload = torch.empty(shape, dtype=dtype, device=self.device)
            ops.append(self._recv_op(msg.payload, spec, header=False))
            posted.append((msg, False))
            index += 1
            state.next_index[peer] = index
        post()
        return state.incoming.get(key)

    def _recv_op(self, tensor: torch.Tensor, transfer: Transfer, *, header: bool) -> dist.P2POp:
        peer = self._global[transfer.src_rank]
        return dist.P2POp(dist.irecv, tensor, peer, self.group, self._tag(transfer, header))

    # -- bounded waits -----------------------------------------------------------------------------------

    def wait(
        self,
        work: dist.Work | None,
        what: str,
        *,
        deadline: float | None = None,
        label: str | None = None,
    ) -> None:
        """Wait for ``work`` at most ``timeout`` seconds (or until ``deadline``, a ``time.monotonic`` value).

        Raises:
            RuntimeError: on timeout or a failed transfer, naming this rank and ``what`` (which says whom it
                waited for and for which action).
        """
        if work is None:
            raise RuntimeError(f"pipeline rank {self.rank}: internal error, nothing was posted for {what}")
        budget = self.timeout if deadline is None else max(deadline - time.monotonic(), 1e-3)
        start = time.perf_counter()
        try:
            finished = work.wait(datetime.timedelta(seconds=budget))
        except Exception as exc:
            if "timed out" in str(exc).lower() or "timeout" in str(exc).lower():
                raise self._timeout_error(what, budget) from exc
            raise RuntimeError(
                f"{self._who()}: failed waiting for {what} (did that rank crash?): {exc}"
            ) from exc
        if finished is False:
            raise self._timeout_error(what, budget)
        if label is not None and self._on_wait is not None:
            self._on_wait(label, start, time.perf_counter())

    def _timeout_error(self, what: str, budget: float) -> RuntimeError:
        return RuntimeError(f"{self._who()}: timed out after {budget:.3g}s waiting for {what}")

    def _who(self) -> str:
        own = self._global[self.rank]
        return f"pipeline rank {self.rank}" + ("" if own == self.rank else f" (global rank {own})")


def _completed(work: dist.Work) -> bool:
    """Non-blocking completion check; a failed transfer counts as not done (the blocking wait reports it)."""
    try:
        return bool(work.is_completed())
    except Exception:  # the error is raised again, with context, by the blocking wait
        return False
