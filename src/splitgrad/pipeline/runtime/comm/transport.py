"""Point-to-point transport of a pipeline runtime: activations forward, input gradients backward.

One :class:`PipelineComm` per rank carries every cross-rank :class:`~splitgrad.pipeline.ir.actions.Transfer` of a
:class:`~splitgrad.pipeline.Schedule` over ``torch.distributed`` (``batch_isend_irecv``: gloo on CPU, NCCL on
accelerators). Rules, all derived from the schedule so both ends agree without talking (what the schedule
implies for this rank's messages is computed once, in ``_plan.py``):

* **Order.** A receiver posts its receives from a peer in the order that peer *sends* (its action order),
  buffering messages it does not need yet. Transports that pair messages by posting order (NCCL) therefore
  never match an activation with a same-shaped gradient, whatever order the receiver consumes them in.
* **Shapes, once.** On the first step (and after :meth:`PipelineComm.reset_shapes`) the first message of each
  channel ``(kind, src_stage)`` is preceded by a small int64 header ``[ndim, dtype code, *shape]``; the
  receiver allocates from it. Both ends keep the shapes: later steps send no header, so every receive can be
  posted ahead (a header's receive cannot be followed by its payload's before the header arrives, and gloo
  only moves a payload once its receive is posted). A message whose shape or dtype differs from its
  channel's is refused on the sending side, naming the action.
* **Batching.** Sends are queued after an action and posted together with the next receive in one
  ``batch_isend_irecv`` call (one NCCL group: the "send forward, receive backward" pairing of 1F1B), or
  flushed before the next compute when no receive comes first. A backend that cannot coalesce (gloo) gets
  the same ops posted one by one on the process group (``ProcessGroup.send`` / ``recv``), which is all
  ``batch_isend_irecv`` and ``isend`` / ``irecv`` do there after their argument checks (on the development
  machine about 60 and 20 us of CPU per call, next to about 80 us for gloo's own posting of a send).
* **Release.** gloo reports a send complete only once it is waited, so a sent tensor is waited (and freed)
  as soon as the schedule proves its peer consumed it: a message the peer produced at or after the action
  that used it has arrived. The rest are waited at the end of the step.
* **Bounded waits.** Every wait uses ``work.wait(timeout)`` (:class:`~._waits.BoundedWaits`); a timeout or a
  dead peer becomes a ``RuntimeError`` naming this rank, the peer, the message and the action it was for.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from ....distributed.group_ref import GroupRef
from ...ir.actions import Action, Schedule, Transfer
from ._header import HEADER_LEN, decode_header, encode_header
from ._plan import plan_messages
from ._state import Channel, Incoming, Meta, Sent, StepState, describe, message_key
from ._waits import BoundedWaits, completed
from .stats import CommStats, ReceiveRecord

__all__ = ["PipelineComm"]

logger = logging.getLogger(__name__)


class PipelineComm:
    """Sends and receives one rank's messages of a schedule (see the module docstring for the rules).

    Args:
        schedule: the schedule every rank runs.
        rank: this rank's index in the schedule (its rank in ``group``).
        group: the pipeline process group (None: the default group).
        device: where receive buffers and headers live (CPU for gloo, the accelerator for NCCL).
        timeout: seconds any single wait may take before raising.
        prefetch: post receives before the actions that need them run (overlaps transfer and compute). Safe
            with gloo, whose receives never block sends; keep it off for NCCL, where a receive posted ahead
            of a send on the same pair stream can deadlock.
        on_wait: ``on_wait(label, start, end)`` called after each blocking receive (timeline recording).
        replaces: the transport of the schedule this one replaces (every rank installs the same new one):
            with the same stage layout, its agreed channel shapes carry over, so no header is exchanged again.
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
        replaces: PipelineComm | None = None,
    ) -> None:
        self.schedule = schedule
        self.rank = rank
        # Looked up at use (distributed/group_ref.py): the transport must not keep the group alive past
        # destroy_process_group().
        self._group = GroupRef(group, owner="PipelineComm.group")
        self.device = device
        self.prefetch_enabled = prefetch
        # NCCL groups a batch into one launch; elsewhere a batch is the ops posted one by one, straight on
        # the process group (what dist.isend / irecv do after their argument checks).
        self._coalesce = dist.get_backend(group) == "nccl"
        self._global = {r: self._global_rank(r) for r in range(schedule.n_ranks)}
        #: Every wait of this rank's traffic, bounded by ``timeout`` (the runtime's collectives use it too).
        self.waits = BoundedWaits(rank, self._global[rank], timeout, on_wait)
        # Who sends what to whom, in which order, with which tag: derived from the schedule, as on every peer.
        self._plan = plan_messages(schedule, rank)
        # Channel shapes both ends agreed on in a completed step (kept across steps; see reset_shapes).
        self._known_out: dict[Channel, Meta] = {}
        self._known_in: dict[Channel, Meta] = {}
        if replaces is not None and replaces.schedule.stage_to_rank == schedule.stage_to_rank:
            # Same stage layout: both ends of every channel keep the shapes agreed so far.
            self._known_out, self._known_in = dict(replaces._known_out), dict(replaces._known_in)
        self._state = StepState()
        #: What the last completed step's messages did (:class:`~splitgrad.pipeline.runtime.comm.CommStats`).
        self.last_stats: CommStats | None = None

    @property
    def group(self) -> dist.ProcessGroup | None:
        """The pipeline process group (None: the default group)."""
        return self._group.get_or_none()

    @property
    def _pg(self) -> dist.ProcessGroup:
        return self._group.get()

    def _rank_of(self, global_rank: int) -> int:
        return next((r for r, g in self._global.items() if g == global_rank), global_rank)

    def _global_rank(self, r: int) -> int:
        if self.group is None or self.group is dist.GroupMember.WORLD:
            return r
        return dist.get_global_rank(self.group, r)

    # -- step boundaries ---------------------------------------------------------------------------------

    def begin_step(self, *, barrier: bool = False) -> None:
        """Start a step: fresh buffers, the channel shapes agreed in earlier steps; with ``barrier``, wait for
        every rank first (:meth:`barrier`: a common time origin for timelines)."""
        self._state = StepState(meta_out=dict(self._known_out), meta_in=dict(self._known_in))
        if barrier:
            self.barrier()

    def reset_shapes(self) -> None:
        """Forget the agreed channel shapes: the next step exchanges headers again (every rank must call it)."""
        self._known_out.clear()
        self._known_in.clear()

    def finish_step(self) -> None:
        """Post queued sends, wait for every send of the step, and check every expected message arrived."""
        self.flush()
        state = self._state
        deadline = time.monotonic() + self.waits.timeout
        for sent in state.sent:
            self._wait_sent(sent, deadline)
        state.sent = []
        received = sum(state.next_index.values())
        expected = self._plan.n_incoming()
        unread = [describe(m.transfer) for m in state.incoming.values() if not m.consumed]
        self._state = StepState()
        if unread or received != expected:
            raise RuntimeError(
                f"pipeline rank {self.rank}: the step ended with {expected - received} of {expected} messages never "
                f"received and these received but never used: {unread}; the schedule and the runtime disagree"
            )
        self._known_out, self._known_in = state.meta_out, state.meta_in
        state.stats.send_bytes = state.stats.recv_bytes = 0
        self.last_stats = state.stats

    def barrier(self) -> None:
        """Wait (bounded) until every rank of the group reaches this point: the step's common time origin."""
        self.waits.collective(
            lambda: dist.barrier(group=self.group, async_op=True),
            "the other pipeline ranks to reach the step's start barrier",
        )

    def broadcast(self, tensor: torch.Tensor, src: int, what: str) -> None:
        """Broadcast ``tensor`` (any shape, same on every rank) from pipeline rank ``src``, bounded."""
        src_global = self._global[src]
        self.waits.collective(
            lambda: dist.broadcast(tensor, src=src_global, group=self.group, async_op=True), what
        )

    def abort(self) -> None:
        """Drop all per-step state after an error (outstanding works are abandoned, not waited)."""
        self._state = StepState()

    # -- sending -----------------------------------------------------------------------------------------

    def queue_send(self, transfer: Transfer, tensor: torch.Tensor, action: Action) -> None:
        """Queue ``tensor`` (any shape) as ``transfer``; it is posted at the next receive or :meth:`flush`.

        Raises:
            ValueError: the tensor's shape or dtype differs from what its channel carries.
        """
        state, plan = self._state, self._plan
        payload = tensor.detach().contiguous()
        channel = (transfer.kind, transfer.src_stage)
        meta = (tuple(payload.shape), payload.dtype)
        peer = self._global[transfer.dst_rank]
        if message_key(transfer) in plan.first_out and channel not in self._known_out:
            state.meta_out[channel] = meta
            header = encode_header(payload, self.device)
            state.queued.append(dist.P2POp(dist.isend, header, peer, self.group, plan.tag(transfer, True)))
            state.queued_about.append((transfer, action))
        elif state.meta_out.get(channel) != meta:
            fixed = channel in self._known_out
            raise ValueError(
                f"pipeline rank {self.rank}: action {action} sends the {describe(transfer)} with shape {meta[0]} "
                f"dtype {meta[1]}, but {'an earlier' if fixed else 'this'} step announced "
                f"{state.meta_out.get(channel)} on that channel; "
                + (
                    "shapes are agreed on the first step and receives are posted ahead with them: call "
                    "PipelineRuntime.reset_shapes() on every rank before a step whose shapes change"
                    if fixed
                    else "every microbatch of a step must have the same shapes"
                )
            )
        state.queued.append(dist.P2POp(dist.isend, payload, peer, self.group, plan.tag(transfer, False)))
        state.queued_about.append((transfer, action))

    def _wait_sent(self, sent: Sent, deadline: float) -> None:
        what = f"rank {sent.transfer.dst_rank} to receive the {describe(sent.transfer)} sent by action {sent.action}"
        self.waits.wait(sent.work, what, deadline=deadline)
        self._state.stats.send_bytes -= sent.tensor.nbytes

    def _release_delivered(self, peer: int, peer_index: int) -> None:
        """Wait (at once: they are done) and drop the sends ``peer`` consumed at or before its action
        ``peer_index``: it has sent us a message from that action on, so it had received them."""
        state, pending, consumed_at = self._state, [], self._plan.consumed_at
        deadline = time.monotonic() + self.waits.timeout
        for sent in state.sent:
            t = sent.transfer
            if t.dst_rank == peer and consumed_at.get(message_key(t), peer_index + 1) <= peer_index:
                self._wait_sent(sent, deadline)
                state.stats.released_early += 1
            else:
                pending.append(sent)
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
        try:
            if self._coalesce:
                works = dist.batch_isend_irecv(ops)
            else:
                works = [self._post(op) for op in ops]
        except Exception as exc:
            sends = sorted({str(a) for _, a in state.queued_about})
            peers = sorted(
                {t.dst_rank for t, _ in state.queued_about} | {self._rank_of(op.peer) for op in recv_ops}
            )
            where = f"before action {action}" if action is not None else "at the end of the step"
            ranks = ("ranks " if len(peers) > 1 else "rank ") + ", ".join(map(str, peers))
            raise RuntimeError(
                f"{self.waits.who()}: failed posting, {where}, the messages of actions {sends} and {len(recv_ops)} "
                f"receive(s), to/from {ranks} (did it crash?): {exc}"
            ) from exc
        n_send = len(state.queued)
        if n_send:
            now = time.perf_counter()
            for work, op, (transfer, about) in zip(works, state.queued, state.queued_about):
                state.sent.append(Sent(work, op.tensor, transfer, about))
                state.stats.add_send(op.tensor.nbytes)
                state.stats.send_posted.setdefault(op.tag, now)
        state.queued, state.queued_about = [], []
        return works[n_send:]

    def _post(self, op: dist.P2POp) -> dist.Work:
        """Post one op on the process group (``op.group_peer`` is the peer's rank in it)."""
        tensor = torch.view_as_real(op.tensor) if op.tensor.is_complex() else op.tensor
        post = self._pg.send if op.op is dist.isend else self._pg.recv
        peer = getattr(op, "group_peer", None)  # torch < 2.6's P2POp holds only the global rank
        if peer is None:
            peer = dist.get_group_rank(self._pg, op.peer)
        return post([tensor], peer, op.tag)

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
        needed = time.perf_counter()
        key = message_key(transfer)
        before = self._state.incoming.get(key)
        ahead = before is not None and before.payload_work is not None
        msg = self._advance(transfer, action, block=True)
        if msg is None or msg.consumed:
            raise RuntimeError(
                f"pipeline rank {self.rank}: action {action} receives the {describe(transfer)} twice"
            )
        label = f"recv {'act' if transfer.kind == 'activation' else 'grad'} {action}"
        what = f"the {describe(transfer)} of action {action} from rank {transfer.src_rank}"
        self.waits.wait(msg.payload_work, what, label=label)
        stats = self._state.stats
        stats.posted_ahead += ahead
        stats.receives.append(
            ReceiveRecord(
                f"{transfer.kind} {action}",
                msg.posted_at,
                needed,
                time.perf_counter(),
                self._plan.tag(transfer, False),
            )
        )
        msg.consumed = True
        payload, msg.payload, msg.payload_work = msg.payload, None, None
        stats.recv_bytes -= payload.nbytes
        if self._state.sent:
            self._release_delivered(transfer.src_rank, self._plan.produced_at[key])
        return payload

    def _advance(self, transfer: Transfer, action: Action | None, *, block: bool) -> Incoming | None:
        """Post (in the sender's order) every receive from ``transfer``'s sender up to and including it.

        A message that opens a channel of unknown shape needs its header before its payload buffer can be
        allocated: with ``block`` the header is waited for; without, posting stops there unless it has
        already arrived.
        """
        state = self._state
        key = message_key(transfer)
        if key not in self._plan.position:
            raise RuntimeError(
                f"pipeline rank {self.rank}: action {action} expects the {describe(transfer)}, which no rank's "
                "schedule sends"
            )
        peer, target = self._plan.position[key]
        msgs = self._plan.from_peer[peer]
        ops: list[dist.P2POp] = []
        posted: list[tuple[Incoming, bool]] = []

        def post() -> None:
            works = self._launch(ops, action)
            now = time.perf_counter()
            for (m, is_header), work in zip(posted, works):
                if is_header:
                    m.header_work = work
                else:
                    m.payload_work, m.posted_at = work, now
            ops.clear()
            posted.clear()

        index = state.next_index.get(peer, 0)
        while index <= target:
            spec, carries_header = msgs[index]
            msg = state.incoming.get(message_key(spec))
            if msg is None:
                msg = state.incoming[message_key(spec)] = Incoming(spec, carries_header)
            channel = (spec.kind, spec.src_stage)
            if msg.carries_header and channel not in state.meta_in:
                if msg.header is None:
                    msg.header = torch.empty(HEADER_LEN, dtype=torch.int64, device=self.device)
                    ops.append(self._recv_op(msg.header, spec, header=True))
                    posted.append((msg, True))
                # Posts queued sends too: never block while holding a message a peer may be waiting for.
                post()
                if not (block or completed(msg.header_work)):
                    break
                what = (
                    f"the header of the {describe(spec)} (before action {action}) from rank {spec.src_rank}"
                )
                self.waits.wait(msg.header_work, what, label=f"recv header {action}" if block else None)
                state.meta_in[channel] = decode_header(msg.header)
                state.stats.headers += 1
            shape, dtype = state.meta_in[channel]
            msg.payload = torch.empty(shape, dtype=dtype, device=self.device)
            state.stats.add_recv(msg.payload.nbytes)
            ops.append(self._recv_op(msg.payload, spec, header=False))
            posted.append((msg, False))
            index += 1
            state.next_index[peer] = index
        post()
        return state.incoming.get(key)

    def _recv_op(self, tensor: torch.Tensor, transfer: Transfer, *, header: bool) -> dist.P2POp:
        peer = self._global[transfer.src_rank]
        return dist.P2POp(dist.irecv, tensor, peer, self.group, self._plan.tag(transfer, header))
