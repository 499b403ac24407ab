"""The expert-parallel MoE layer: a router, an all-to-all dispatcher and this rank's share of the experts.

It is built from the same pieces as the single-process :class:`~splitgrad.models.MoEMLP` (the norm, the
:class:`~splitgrad.models.router.TopKRouter`, the experts and the token permutation of
:mod:`splitgrad.models.experts`) with an :class:`~splitgrad.parallel.expert.dispatcher.AllToAllDispatcher`
between the permutation and the experts. On the flattened local tokens ``x: (T, hidden)``::

    probs, w, e = router.route(norm(x))              # router and norm replicated (dense parameters)
    rows, order = permute_tokens(h, e)               # sorted by global expert = grouped by owning rank
    rows, m_splits = dispatcher.dispatch(rows)       # to the experts' ranks, grouped by local expert
    y = fc2(act(fc1(rows)))                          # GroupedLinear over the local experts, wgrad deferrable
    y = dispatcher.combine(y)                        # back to the tokens' ranks
    out = unpermute_tokens(y, order, w)              # token order, the k copies weighted and summed

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
from ...models.experts import make_experts, permute_tokens, run_experts, unpermute_tokens
from ...models.gpt import Norm
from ...models.moe import attach_aux_loss
from ...models.router import TopKRouter
from .all_to_all import wait_work
from .dispatch_wgrad import run_expert_wgrad
from .dispatcher import AllToAllDispatcher

__all__ = ["ExpertParallelMoEMLP"]

logger = logging.getLogger(__name__)


class ExpertParallelMoEMLP(nn.Module):
    """:class:`~splitgrad.models.MoEMLP`'s expert-parallel twin: its experts sharded over ``ep_group``.

    Shapes as :class:`~splitgrad.models.MoEMLP`: ``(batch, seq, hidden)`` -> ``(batch, seq, hidden)``; so are
    the submodules and their state-dict keys (``norm``, ``router``, ``fc1``, ``fc2``), except that ``fc1`` /
    ``fc2`` hold only the ``local_experts`` experts of this rank (``weight{j}`` is global expert
    ``expert_offset + j``; :func:`~splitgrad.parallel.expert.load_full_state_dict` maps them).
    ``last_tokens_per_expert`` is the *global* count per expert; ``last_aux_loss`` is this rank's share (its
    mean over ``dp_group`` is the global aux loss); ``last_dispatch_splits`` is ``(rows sent to, rows received
    from)`` each rank of ``ep_group`` by the last dispatch.

    Args:
        config: the model config (``num_experts`` global experts).
        ep_group: the expert-parallel group; its size must divide ``num_experts``.
        dp_group: every rank whose tokens form the global batch (the dense parameters' data-parallel group,
            ``ep_group`` x the expert-data-parallel group); None: ``ep_group``.
        experts: one of :data:`~splitgrad.models.experts.EXPERT_KINDS` (``"module"``: ``splitgrad.GroupedLinear``,
            ``"ops"``: ``splitgrad.ops.GroupedLinear``).

    Raises:
        ValueError: the expert-parallel size does not divide ``num_experts``, or an unknown ``experts`` kind.
    """

    def __init__(
        self,
        config: MoEConfig,
        ep_group: dist.ProcessGroup,
        dp_group: dist.ProcessGroup | None = None,
        *,
        experts: str = "module",
    ) -> None:
        super().__init__()
        self.dispatcher = AllToAllDispatcher(ep_group, config.num_experts, owner="ExpertParallelMoEMLP")
        """The all-to-all token exchange over ``ep_group`` (not a submodule: it holds no parameters)."""
        # Looked up at use (distributed/group_ref.py): a model left in the user's globals must not keep the
        # group's gloo workers alive past destroy_process_group().
        self._dp_group = GroupRef(
            dp_group if dp_group is not None else ep_group, owner="ExpertParallelMoEMLP.dp_group"
        )
        self.dp_size = dist.get_world_size(self.dp_group)
        self.num_experts = config.num_experts
        self.activation = config.activation
        self.experts_kind = experts
        self.aux_loss_scale = 1.0
        self.last_aux_loss: torch.Tensor | None = None
        self.last_tokens_per_expert: list[int] | None = None
        self.last_dispatch_splits: tuple[list[int], list[int]] | None = None
        #: Run the experts' deferred weight gradients inside the backward's dispatch all-to-all (while it is in
        #: flight) instead of at ``backward_dw``; read when the dispatch backward runs. See ``dispatch_wgrad.py``.
        self.wgrad_in_dispatch = False
        #: Set to a list to record each such run as ``("expert wgrad", start, end)`` (perf_counter seconds).
        self.wgrad_log: list | None = None
        #: Set to a list to record the aux-loss all-reduce's blocking wait as ``(name, start, end)`` (the
        #: dispatcher's ``wait_log`` records the exchanges'; setting :attr:`wait_log` sets both).
        self._wait_log: list | None = None
        self.norm = Norm(config)
        self.router = TopKRouter(config)
        self.fc1, self.fc2 = make_experts(config, self.dispatcher.local_experts, experts)
        # Expert parameters are reduced over the expert-data-parallel group, not the dense one.
        for p in self.expert_parameters():
            p.expert_parallel = True

    @property
    def ep_group(self) -> dist.ProcessGroup:
        """The expert-parallel group."""
        return self.dispatcher.group

    @property
    def dp_group(self) -> dist.ProcessGroup:
        """The dense parameters' data-parallel group (``ep_group`` unless one was given)."""
        return self._dp_group.get()

    @property
    def ep_size(self) -> int:
        """Ranks in ``ep_group``."""
        return self.dispatcher.ep_size

    @property
    def ep_rank(self) -> int:
        """This rank in ``ep_group``."""
        return self.dispatcher.ep_rank

    @property
    def local_experts(self) -> int:
        """Experts held on this rank (``num_experts / ep_size``)."""
        return self.dispatcher.local_experts

    @property
    def expert_offset(self) -> int:
        """Global index of this rank's first expert."""
        return self.dispatcher.expert_offset

    @property
    def comm_log(self) -> list | None:
        """Set to a list to record every exchange as ``(name, start, end)`` (perf_counter seconds; timelines)."""
        return self.dispatcher.comm_log

    @comm_log.setter
    def comm_log(self, log: list | None) -> None:
        self.dispatcher.comm_log = log

    @property
    def wait_log(self) -> list | None:
        """Set to a list to record every blocking wait of the layer's collectives (both directions, token counts
        and aux-loss all-reduce too) as ``(name, start, end)``: the time the thread was blocked (diagnostics)."""
        return self._wait_log

    @wait_log.setter
    def wait_log(self, log: list | None) -> None:
        self._wait_log = self.dispatcher.wait_log = log

    def expert_parameters(self) -> list[nn.Parameter]:
        """The parameters of this rank's experts (``fc1`` and ``fc2``)."""
        return [*self.fc1.parameters(), *self.fc2.parameters()]

    def residual_output_weights(self) -> list[nn.Parameter]:
        """fc2's weights (they write into the residual stream): one per expert, or the one grouped weight."""
        return list(self.fc2.grouped_params().weights)

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
        tokens = h.shape[0]
        probs, weights, experts = self.router.route(h)
        counts = torch.bincount(experts.reshape(-1), minlength=self.num_experts)
        count_exchange = self.dispatcher.start_counts(counts)
        sent, order = permute_tokens(h, experts)

        # Global statistics for the aux loss, started now and waited only after the experts ran.
        stats = torch.cat([counts, counts.new_tensor([tokens])])
        stats_work = dist.all_reduce(stats, group=self.dp_group, async_op=True)

        rows, m_splits, plan = yield from self.dispatcher.dispatch(
            sent, counts, count_exchange, also=(stats_work,), in_backward_flight=self._in_dispatch_backward
        )
        y = run_experts(self.fc1, self.fc2, rows, m_splits, self.activation)
        y = yield from self.dispatcher.combine(y, plan, also=(stats_work,))
        out = unpermute_tokens(y, order, weights)

        wait_work(stats_work, "aux-loss count all-reduce", self.dp_group, wait_log=self._wait_log)
        global_counts, global_tokens = stats[:-1], int(stats[-1])
        aux = self._aux_share(probs, global_counts, global_tokens)
        self.last_aux_loss = aux.detach()
        self.last_tokens_per_expert = global_counts.tolist()
        self.last_dispatch_splits = (plan.in_splits, plan.out_splits)
        out = attach_aux_loss(out, aux, scale=self.aux_loss_scale, coef=self.router.aux_loss_coef)
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
        router = self.router
        f = global_counts.to(probs.dtype) / (global_tokens * router.top_k)
        p_share = probs.sum(0) * (self.dp_size / global_tokens)
        return router.aux_loss_coef * self.num_experts * (f * p_share).sum()

    def extra_repr(self) -> str:
        return (
            f"experts={self.experts_kind}, ep_rank={self.ep_rank}, ep_size={self.ep_size}, "
            f"local_experts={self.local_experts}, expert_offset={self.expert_offset}"
        )
