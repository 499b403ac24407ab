"""The expert-parallel MoE layer: experts sharded over a process group, tokens moved by all-to-all.

Rank ``r`` of an expert-parallel group of size ``ep`` owns the ``E / ep`` consecutive experts
``[r * E / ep, (r + 1) * E / ep)``. On the flattened local tokens ``x: (T, hidden)``::

    probs, w, e = route(norm(x))                     # router and norm replicated (dense parameters)
    sorted copies by global expert                   # = grouped by owning rank, as in the single-process layer
    counts -> exchange_counts -> received counts     # split sizes first (started before the permutation)
    dispatch all_to_all -> rows by (source rank, local expert)
    regroup by local expert (stable: source-rank order within an expert = the global token order)
    fc2(act(fc1(rows)))                              # GroupedLinear over the local experts, wgrad deferrable
    undo the regroup -> combine all_to_all -> unpermute, weight by w, sum the k copies

Exactness: when the global batch is the concatenation of the ranks' local batches (rank order), each expert
sees exactly the rows, in the same order, as in the single-process :class:`~splitgrad.models.MoEMLP`. The
load-balancing loss uses the *global* routed counts (all-reduced over ``dp_group``, every rank with distinct
tokens) and this rank's router probabilities, weighted so that the mean over ``dp_group`` of the ranks' aux losses
is the global aux loss: averaging the dense gradients over ``dp_group`` gives the single-process gradient.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from torch import nn

from ...core.steps import Steps, run_steps
from ...distributed.group_ref import GroupRef
from ...models.config import MoEConfig
from ...models.gpt import Norm, split_kwargs
from ...models.moe import AuxLossInjector, MoEMLP, moe_activation
from ...module.grouped_linear import GroupedLinear
from ...module.linear import Linear
from ...ops.basic.grouped_linear import GroupedLinear as GroupedLinearOp
from .all_to_all import await_exchange, finish_all_to_all, start_all_to_all, start_count_exchange, wait_work
from .dispatch_wgrad import run_expert_wgrad

__all__ = ["EXPERT_KINDS", "ExpertParallelMoEMLP"]

logger = logging.getLogger(__name__)

#: ``"module"``: experts are :class:`splitgrad.GroupedLinear` modules; ``"ops"``: :class:`splitgrad.ops.GroupedLinear`.
EXPERT_KINDS = ("module", "ops")


def _inverse(order: torch.Tensor) -> torch.Tensor:
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return inverse


class ExpertParallelMoEMLP(MoEMLP):
    """:class:`~splitgrad.models.MoEMLP` with its experts sharded over ``ep_group``.

    Shapes as :class:`~splitgrad.models.MoEMLP`: ``(batch, seq, hidden)`` -> ``(batch, seq, hidden)``.
    ``fc1`` / ``fc2`` hold only the ``local_experts`` experts of this rank (``weight{j}`` is global expert
    ``expert_offset + j``); ``last_tokens_per_expert`` is the *global* count per expert; ``last_aux_loss`` is
    this rank's share (its mean over ``dp_group`` is the global aux loss); ``last_dispatch_splits`` is
    ``(rows sent to, rows received from)`` each rank of ``ep_group`` by the last dispatch.

    Args:
        config: the model config (``num_experts`` global experts).
        ep_group: the expert-parallel group; its size must divide ``num_experts``.
        dp_group: every rank whose tokens form the global batch (the dense parameters' data-parallel group,
            ``ep_group`` x the expert-data-parallel group); None: ``ep_group``.
        experts: one of :data:`EXPERT_KINDS`.
    """

    def __init__(
        self,
        config: MoEConfig,
        ep_group: dist.ProcessGroup,
        dp_group: dist.ProcessGroup | None = None,
        *,
        experts: str = "module",
    ) -> None:
        nn.Module.__init__(self)
        if experts not in EXPERT_KINDS:
            raise ValueError(f"ExpertParallelMoEMLP: experts must be one of {EXPERT_KINDS}, got {experts=}")
        ep_size = dist.get_world_size(ep_group)
        if config.num_experts % ep_size:
            raise ValueError(
                f"ExpertParallelMoEMLP: the expert-parallel size must divide num_experts, got "
                f"num_experts={config.num_experts} ep_size={ep_size}"
            )
        self.ep_size, self.ep_rank = ep_size, dist.get_rank(ep_group)
        # Held weakly or looked up at use (distributed/group_ref.py): a model left in the user's globals must not
        # keep the groups' gloo workers alive past destroy_process_group().
        self._groups = {
            name: GroupRef(group, owner=f"ExpertParallelMoEMLP.{name}")
            for name, group in (
                ("ep_group", ep_group),
                ("dp_group", dp_group if dp_group is not None else ep_group),
            )
        }
        self.dp_size = dist.get_world_size(self.dp_group)
        self._init_routing(config)
        self.local_experts = config.num_experts // ep_size
        self.expert_offset = self.ep_rank * self.local_experts
        self.experts_kind = experts
        self.last_dispatch_splits: tuple[list[int], list[int]] | None = None
        #: Set to a list to record every exchange as ``(name, start, end)`` (perf_counter seconds; timelines).
        self.comm_log: list | None = None
        #: Run the experts' deferred weight gradients inside the backward's dispatch all-to-all (while it is in
        #: flight) instead of at ``backward_dw``; read when the dispatch backward runs. See ``dispatch_wgrad.py``.
        self.wgrad_in_dispatch = False
        #: Set to a list to record each such run as ``("expert wgrad", start, end)`` (perf_counter seconds).
        self.wgrad_log: list | None = None
        #: Set to a list to record every blocking wait of the layer's collectives (both directions, token counts and
        #: aux-loss all-reduce too) as ``(name, start, end)``: the time the thread was blocked (diagnostics).
        self.wait_log: list | None = None
        h, f, n = config.hidden_size, config.moe_ffn_hidden_size, self.local_experts
        width = 2 * f if config.activation in ("swiglu", "geglu") else f
        self.norm = Norm(config)
        self.router = Linear(h, config.num_experts, False, **split_kwargs(config))
        if experts == "module":
            self.fc1 = GroupedLinear(n, h, width, config.bias, **split_kwargs(config))
            self.fc2 = GroupedLinear(n, f, h, config.bias, **split_kwargs(config))
        else:
            kw = {
                "bias": config.bias,
                "delay_wgrad_compute": config.delay_wgrad_compute,
                "accumulate_into_main_grad": config.fuse_wgrad_accumulation,
                "dtype": config.params_dtype,
            }
            self.fc1 = GroupedLinearOp(n, h, width, **kw)
            self.fc2 = GroupedLinearOp(n, f, h, **kw)
        # Expert parameters are reduced over the expert-data-parallel group, not the dense one.
        for p in self.expert_parameters():
            p.expert_parallel = True

    @property
    def ep_group(self) -> dist.ProcessGroup:
        """The expert-parallel group."""
        return self._groups["ep_group"].get()

    @property
    def dp_group(self) -> dist.ProcessGroup:
        """The dense parameters' data-parallel group (``ep_group`` unless one was given)."""
        return self._groups["dp_group"].get()

    def expert_parameters(self) -> list[nn.Parameter]:
        """The parameters of this rank's experts (``fc1`` and ``fc2``)."""
        return [*self.fc1.parameters(), *self.fc2.parameters()]

    def residual_output_weights(self) -> list[nn.Parameter]:
        """fc2's local per-expert matrices (they write into the residual stream)."""
        return [getattr(self.fc2, f"weight{j}") for j in range(self.local_experts)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return run_steps(self.forward_steps(x))

    def forward_steps(self, x: torch.Tensor) -> Steps:
        """:meth:`forward` as steps (see :mod:`splitgrad.core.steps`): yields right after issuing the dispatch
        and right after issuing the combine all-to-all; returns the output ``(batch, seq, hidden)``.

        The token-count exchange and the aux-loss all-reduce are no step boundaries: each is started early and
        waited late inside a step. A single-thread driver runs other work at each yield (the other microbatch's
        backward) while the exchange is in flight.
        """
        shape = x.shape
        h = self.norm(x.reshape(-1, shape[-1]))
        tokens, k = h.shape[0], self.top_k
        probs, weights, experts = self.route(h)

        # Permute as the single-process layer: copies sorted by global expert, hence by owning rank.
        flat = experts.reshape(-1)
        counts = torch.bincount(flat, minlength=self.num_experts)
        # The split-size exchange is started first and waited just before the dispatch: its round trip runs
        # under the permutation below instead of as a blocking step of its own.
        count_exchange = start_count_exchange(counts, self.ep_group, self.comm_log, self.wait_log)
        order = torch.argsort(flat, stable=True)
        copies = h.unsqueeze(1).expand(tokens, k, h.shape[-1]).reshape(-1, h.shape[-1])
        sent = copies.index_select(0, order)

        # Global statistics for the aux loss, started now and waited only after the experts ran.
        stats = torch.cat([counts, counts.new_tensor([tokens])])
        stats_work = dist.all_reduce(stats, group=self.dp_group, async_op=True)

        try:
            received_counts = count_exchange.wait()  # (ep, local_experts), host
        except BaseException:
            stats_work.wait()  # never leave a collective unwaited
            raise
        in_splits = counts.view(self.ep_size, -1).sum(1).tolist()
        out_splits = received_counts.sum(1).tolist()
        dispatch = start_all_to_all(
            sent,
            out_splits,
            in_splits,
            self.ep_group,
            what="dispatch",
            log=self.comm_log,
            wait_log=self.wait_log,
        )
        yield from await_exchange(dispatch, stats_work)
        rows = finish_all_to_all(sent, dispatch, in_backward_flight=self._in_dispatch_backward)

        # Received rows are grouped by (source rank, local expert); the experts need them by local expert.
        local_ids = torch.arange(self.local_experts, device=rows.device).repeat(self.ep_size)
        row_expert = torch.repeat_interleave(local_ids, received_counts.flatten().to(rows.device))
        regroup = torch.argsort(row_expert, stable=True)
        m_splits = received_counts.sum(0).tolist()
        y = self.fc1(rows.index_select(0, regroup), m_splits)
        y = self.fc2(moe_activation(y, self.activation), m_splits)
        y = y.index_select(0, _inverse(regroup))
        combine = start_all_to_all(
            y, in_splits, out_splits, self.ep_group, what="combine", log=self.comm_log, wait_log=self.wait_log
        )
        yield from await_exchange(combine, stats_work)
        y = finish_all_to_all(y, combine)

        out = (y.index_select(0, _inverse(order)).view(tokens, k, -1) * weights.unsqueeze(-1)).sum(1)

        wait_work(stats_work, "aux-loss count all-reduce", self.dp_group, wait_log=self.wait_log)
        global_counts, global_tokens = stats[:-1], int(stats[-1])
        aux = self._aux_share(probs, global_counts, global_tokens)
        self.last_aux_loss = aux.detach()
        self.last_tokens_per_expert = global_counts.tolist()
        self.last_dispatch_splits = (in_splits, out_splits)
        if torch.is_grad_enabled() and aux.requires_grad and self.aux_loss_coef > 0:
            out = AuxLossInjector.apply(out, aux, self.aux_loss_scale)
        return out.view(shape)

    def _in_dispatch_backward(self) -> None:
        # Called by the dispatch backward while its exchange is in flight: fc1's and fc2's dgrad just parked
        # this microbatch's expert W, which does not depend on the exchange.
        if self.wgrad_in_dispatch:
            run_expert_wgrad([self.fc1, self.fc2], self.wgrad_log)

    def _aux_share(
        self, probs: torch.Tensor, global_counts: torch.Tensor, global_tokens: int
    ) -> torch.Tensor:
        """This rank's share of ``coef * E * sum_i f_i * P_i``: global ``f``, local probabilities.

        ``P_i`` of the global batch is ``sum over ranks of probs.sum(0) / global_tokens``; multiplying the local
        sum by ``dp_size`` makes the *mean* over ranks the global loss, matching data-parallel averaging.
        """
        f = global_counts.to(probs.dtype) / (global_tokens * self.top_k)
        p_share = probs.sum(0) * (self.dp_size / global_tokens)
        return self.aux_loss_coef * self.num_experts * (f * p_share).sum()

    def extra_repr(self) -> str:
        return (
            f"experts={self.experts_kind}, ep_rank={self.ep_rank}, ep_size={self.ep_size}, "
            f"local_experts={self.local_experts}, expert_offset={self.expert_offset}"
        )
