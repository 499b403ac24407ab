"""The all-to-all token dispatcher of an expert-parallel MoE layer: permuted token copies to the ranks owning
their experts, and the expert outputs back.

Rank ``r`` of an expert-parallel group of size ``ep`` owns the ``E / ep`` consecutive experts
``[r * E / ep, (r + 1) * E / ep)``. The layer hands the dispatcher its token copies sorted by global expert (so
grouped by owning rank, :func:`~splitgrad.models.experts.permute_tokens`) and the per-expert counts::

    counts --all_to_all--> received counts   # split sizes first (start_counts, before the permutation)
    dispatch all_to_all                      # rows arrive grouped by (source rank, local expert)
    regroup by local expert (stable)         # source-rank order inside an expert = the global token order
    ... the layer runs its local experts ...
    undo the regroup, combine all_to_all     # the outputs back to the tokens' ranks, in the sent order

:meth:`AllToAllDispatcher.dispatch` and :meth:`AllToAllDispatcher.combine` are steps
(:mod:`splitgrad.core.steps`): each yields right after issuing its exchange, so an overlapped driver runs other
work while it is in flight.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Generator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ...distributed.group_ref import GroupRef
from ...models.experts import inverse_permutation
from .all_to_all import (
    CountExchange,
    PendingExchange,
    await_exchange,
    finish_all_to_all,
    start_all_to_all,
    start_count_exchange,
)

__all__ = ["AllToAllDispatcher", "DispatchPlan"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class DispatchPlan:
    """What :meth:`AllToAllDispatcher.combine` needs from the dispatch it undoes."""

    regroup: torch.Tensor
    """``(rows,)`` the stable sort of the received rows by local expert."""
    in_splits: list[int]
    """Rows sent to each rank of the group."""
    out_splits: list[int]
    """Rows received from each rank of the group."""


class AllToAllDispatcher:
    """Exchanges an expert-parallel layer's token copies over ``ep_group``.

    Args:
        ep_group: the expert-parallel group; its size must divide ``num_experts``.
        num_experts: the global number of experts.
        owner: who holds the group, for error messages.

    Raises:
        ValueError: the group's size does not divide ``num_experts``.
    """

    def __init__(self, ep_group: dist.ProcessGroup, num_experts: int, *, owner: str) -> None:
        ep_size = dist.get_world_size(ep_group)
        if num_experts % ep_size:
            raise ValueError(
                f"{owner}: the expert-parallel size must divide num_experts, got num_experts={num_experts} "
                f"ep_size={ep_size}"
            )
        # Held weakly or looked up at use (distributed/group_ref.py): a model left in the user's globals must not
        # keep the group's gloo workers alive past destroy_process_group().
        self._group = GroupRef(ep_group, owner=f"{owner}.ep_group")
        self.ep_size, self.ep_rank = ep_size, dist.get_rank(ep_group)
        self.local_experts = num_experts // ep_size
        #: Global index of this rank's first expert.
        self.expert_offset = self.ep_rank * self.local_experts
        #: Set to a list to record every exchange as ``(name, start, end)`` (perf_counter seconds; timelines).
        self.comm_log: list | None = None
        #: Set to a list to record every blocking wait of the exchanges (both directions, token counts too) as
        #: ``(name, start, end)``: the time the thread was blocked (diagnostics).
        self.wait_log: list | None = None

    @property
    def group(self) -> dist.ProcessGroup:
        """The expert-parallel group."""
        return self._group.get()

    def start_counts(self, counts: torch.Tensor) -> CountExchange:
        """Start exchanging ``counts: (E,)`` int64 (copies this rank sends to each global expert); started
        before the permutation, its round trip runs under it instead of as a blocking step of its own."""
        return start_count_exchange(counts, self.group, self.comm_log, self.wait_log)

    def dispatch(
        self,
        sent: torch.Tensor,
        counts: torch.Tensor,
        count_exchange: CountExchange,
        *,
        also: tuple[dist.Work, ...] = (),
        in_backward_flight: Callable[[], object] | None = None,
    ) -> Generator[PendingExchange, None, tuple[torch.Tensor, list[int], DispatchPlan]]:
        """Steps: send ``sent`` to the experts' ranks; yields once, with the exchange in flight.

        Args:
            sent: ``(T * k, hidden)`` this rank's token copies sorted by global expert.
            counts: ``(E,)`` int64, copies per global expert (``sent``'s grouping).
            count_exchange: :meth:`start_counts` of ``counts``.
            also: other collectives of the layer in flight, waited if the forward is abandoned here.
            in_backward_flight: called by the dispatch's backward while its exchange is in flight.

        Returns:
            ``(rows, m_splits, plan)``: ``rows: (sum(m_splits), hidden)`` the received copies grouped by local
            expert, ``m_splits`` rows per local expert, and the plan :meth:`combine` undoes.
        """
        try:
            received_counts = count_exchange.wait()  # (ep, local_experts), host
        except BaseException:
            for work in also:
                work.wait()  # never leave a collective unwaited
            raise
        in_splits = counts.view(self.ep_size, -1).sum(1).tolist()
        out_splits = received_counts.sum(1).tolist()
        pending = start_all_to_all(
            sent,
            out_splits,
            in_splits,
            self.group,
            what="dispatch",
            log=self.comm_log,
            wait_log=self.wait_log,
        )
        yield from await_exchange(pending, *also)
        rows = finish_all_to_all(sent, pending, in_backward_flight=in_backward_flight)
        # Received rows are grouped by (source rank, local expert); the experts need them by local expert.
        local_ids = torch.arange(self.local_experts, device=rows.device).repeat(self.ep_size)
        row_expert = torch.repeat_interleave(local_ids, received_counts.flatten().to(rows.device))
        regroup = torch.argsort(row_expert, stable=True)
        m_splits = received_counts.sum(0).tolist()
        return rows.index_select(0, regroup), m_splits, DispatchPlan(regroup, in_splits, out_splits)

    def combine(
        self, y: torch.Tensor, plan: DispatchPlan, *, also: tuple[dist.Work, ...] = ()
    ) -> Generator[PendingExchange, None, torch.Tensor]:
        """Steps: send the expert outputs ``y: (rows, hidden)`` (grouped by local expert) back; yields once, with
        the exchange in flight. Returns ``(T * k, hidden)`` in the order :meth:`dispatch` was given."""
        y = y.index_select(0, inverse_permutation(plan.regroup))
        pending = start_all_to_all(
            y,
            plan.in_splits,
            plan.out_splits,
            self.group,
            what="combine",
            log=self.comm_log,
            wait_log=self.wait_log,
        )
        yield from await_exchange(pending, *also)
        return finish_all_to_all(y, pending)
