"""Megatron-Core with splitgrad layers: its ``DistributedDataParallel``, and its interleaved pipeline order.

**Data parallel.** Wrap a model made of splitgrad layers in Megatron-Core's own
``megatron.core.distributed.DistributedDataParallel``; nothing of splitgrad's wraps it. Megatron gives every
parameter a ``main_grad`` (a view into its bucket), ``grad_added_to_main_grad = False``, and one hook
(``_make_backward_post_hook``) that adds ``.grad`` into ``main_grad`` unless the flag is set, clears
``.grad`` and, with ``overlap_grad_reduce=True``, asserts ``.grad`` was there and reports the parameter ready
(``register_grad_ready``). Where the hook sits is Megatron's choice, made per parameter when the wrapper is
built:

=========================  ====================================  =============================================
splitgrad layer            Megatron ``ddp_config``               Megatron's hook fires
=========================  ====================================  =============================================
immediate                  any                                   on the AccumulateGrad node, in backward
delayed (fused or not)     ``delay_wgrad_compute=True``          as the layer's wgrad hook, in ``backward_dw``
fused, not delayed         ``delay_wgrad_compute=False``         on the AccumulateGrad node, after the layer's
                                                                 backward (reads the placeholder ``.grad``)
fused, not delayed         ``delay_wgrad_compute=True``          as the layer's wgrad hook, inside backward
=========================  ====================================  =============================================

A fused layer shows the hook a placeholder ``.grad`` (TE's dummy-wgrad convention,
:mod:`splitgrad.core.placeholder`), so the overlap assertion holds and nothing is added twice.
:func:`check_ddp` refuses the two layouts that lose or double-count a gradient.

**Interleaved order.** :func:`interleaved_schedule` builds Megatron's interleaved 1F1B order with Megatron's
own functions and translates it into a splitgrad :class:`~splitgrad.pipeline.Schedule` (to validate, simulate
or run it). Megatron writes one list of integers per pipeline rank
(``megatron.core.transformer.cuda_graphs.convert_schedule_table_to_order``): ``+c`` is a forward of the
rank's model chunk ``c`` and ``-c`` a backward of it, ``c`` counted from 1. Which microbatch comes from its
schedule table (``get_schedule_table``): the ``i``-th forward of the order runs entry ``i`` of the table,
``(microbatch, chunk k)``; the ``j``-th backward runs entry ``j``'s microbatch on chunk ``v - 1 - k``
(backward walks the chunks in reverse). splitgrad numbers stages globally: chunk ``c`` of rank ``r`` of ``p``
is stage ``(c - 1) * p + r`` (Megatron's virtual pipeline layout), a forward is ``F``, a backward ``BW``.

megatron-core is imported only inside these functions (``pip install 'splitgrad[megatron]'``).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from torch import nn

from ..core import split_modules
from ..pipeline.ir.actions import Action, ActionKind, Schedule

__all__ = ["check_ddp", "interleaved_orders", "interleaved_schedule", "schedule_from_orders"]


def check_ddp(ddp: Any) -> None:
    """Refuse a Megatron ``DistributedDataParallel`` that would lose or double-count a splitgrad gradient.

    Args:
        ddp: a built ``megatron.core.distributed.DistributedDataParallel`` (its public ``module`` and
            ``ddp_config`` are read).

    Raises:
        ValueError: a splitgrad layer delays its weight gradient but ``ddp_config.delay_wgrad_compute`` is
            False (Megatron then hooks the AccumulateGrad node, which runs before ``backward_dw`` writes the
            gradient: a ``.grad`` written there is never reduced); or a parameter's hook was registered on more
            than one module (nested split-capable modules: it fires more than once per ``backward_dw``).
    """
    model: nn.Module = ddp.module
    delay = bool(ddp.ddp_config.delay_wgrad_compute)
    late = [name for name, m in split_modules(model) if m.need_backward_dw()]
    if late and not delay:
        raise ValueError(
            f"Megatron DistributedDataParallel: splitgrad layers {late[:5]} delay their weight gradient "
            "(delay_wgrad_compute=True) but ddp_config.delay_wgrad_compute=False, so Megatron hooks their "
            "AccumulateGrad nodes, which run before backward_dw() writes the gradient. Build the wrapper with "
            "DistributedDataParallelConfig(delay_wgrad_compute=True)"
        )
    if not delay:
        return
    # Megatron's rule (DistributedDataParallel.__init__): a parameter with skip_backward_post_hook gets one
    # hook on *every* module of the model that has register_wgrad_accumulation_and_reduce_hooks and owns it.
    owners: dict[int, list[str]] = {}
    for name, m in model.named_modules():
        if hasattr(m, "register_wgrad_accumulation_and_reduce_hooks"):
            for p in m.parameters():
                if p.requires_grad and getattr(p, "skip_backward_post_hook", False):
                    owners.setdefault(id(p), []).append(name or type(model).__name__)
    names = {id(p): n for n, p in model.named_parameters()}
    twice = {names[i]: mods for i, mods in owners.items() if len(mods) > 1}
    if twice:
        raise ValueError(
            "Megatron DistributedDataParallel registers a parameter's hook on every module that owns it and has "
            f"register_wgrad_accumulation_and_reduce_hooks; these parameters have several: {twice}. Their hook "
            "would fire more than once per backward_dw (the second time without a gradient). Wrap the split "
            "layers themselves, not a split-capable container around them"
        )


def interleaved_orders(
    n_ranks: int, stages_per_rank: int, n_microbatches: int, *, microbatch_group_size: int | None = None
) -> tuple[list[tuple[int, int]], list[list[int]]]:
    """Megatron's schedule table and its per-rank interleaved 1F1B orders, from Megatron's own functions.

    Args:
        n_ranks: pipeline-parallel size ``p``.
        stages_per_rank: model chunks per rank ``v`` (Megatron's virtual pipeline size), ``>= 2``.
        n_microbatches: microbatches per step.
        microbatch_group_size: Megatron's ``microbatch_group_size_per_vp_stage`` (default ``p``, its default).

    Returns:
        ``(table, orders)``: ``get_schedule_table(...)`` (``(microbatch, chunk)`` per virtual microbatch) and,
        per rank, ``convert_schedule_table_to_order(warm-up of that rank, v, table)``, the warm-up counts from
        ``get_pp_rank_microbatches``.
    """
    from megatron.core.pipeline_parallel.schedules import get_pp_rank_microbatches, get_schedule_table
    from megatron.core.transformer.cuda_graphs import convert_schedule_table_to_order

    group = n_ranks if microbatch_group_size is None else microbatch_group_size
    table = get_schedule_table(n_microbatches, stages_per_rank, group)
    orders = []
    for rank in range(n_ranks):
        # get_pp_rank_microbatches reads only these three attributes of its p2p communicator.
        comm = SimpleNamespace(
            pp_group=SimpleNamespace(size=lambda: n_ranks, rank=lambda rank=rank: rank),
            virtual_pipeline_model_parallel_size=stages_per_rank,
        )
        _, _, warmup, _ = get_pp_rank_microbatches(
            n_microbatches, stages_per_rank, group, p2p_communicator=comm
        )
        orders.append(convert_schedule_table_to_order(warmup, stages_per_rank, table))
    return table, orders


def schedule_from_orders(
    table: list[tuple[int, int]], orders: list[list[int]], n_microbatches: int, stages_per_rank: int
) -> Schedule:
    """Translate Megatron's per-rank orders (``+c`` forward, ``-c`` backward of chunk ``c``, from 1) into a
    splitgrad :class:`~splitgrad.pipeline.Schedule` (see the module docstring for the mapping).

    Raises:
        ValueError: an entry disagrees with the table (a forward ``+c`` whose table entry is not chunk
            ``c - 1``, a backward ``-c`` whose entry is not chunk ``v - c``), or an order is not one forward
            and one backward per table entry.
    """
    p, v = len(orders), stages_per_rank
    rank_actions = []
    for rank, order in enumerate(orders):
        actions, n_f, n_b = [], 0, 0
        for entry in order:
            if entry > 0:
                microbatch, chunk = table[n_f]
                expected, n_f, kind = chunk + 1, n_f + 1, ActionKind.F
            else:
                microbatch, chunk = table[n_b]
                chunk = v - 1 - chunk  # the j-th backward walks entry j's chunks in reverse
                expected, n_b, kind = chunk + 1, n_b + 1, ActionKind.BW
            if abs(entry) != expected:
                raise ValueError(
                    f"Megatron order of rank {rank}: entry {entry} at forward {n_f} / backward {n_b} does not "
                    f"match the schedule table (expected chunk {expected})"
                )
            actions.append(Action((abs(entry) - 1) * p + rank, kind, microbatch))
        if n_f != len(table) or n_b != len(table):
            raise ValueError(
                f"Megatron order of rank {rank} has {n_f} forwards and {n_b} backwards, expected {len(table)} each"
            )
        rank_actions.append(tuple(actions))
    stage_to_rank = tuple(s % p for s in range(p * v))
    return Schedule("megatron-interleaved", n_microbatches, stage_to_rank, tuple(rank_actions))


def interleaved_schedule(
    n_ranks: int, stages_per_rank: int, n_microbatches: int, *, microbatch_group_size: int | None = None
) -> Schedule:
    """Megatron-Core's interleaved 1F1B as a splitgrad :class:`~splitgrad.pipeline.Schedule`
    (:func:`interleaved_orders` translated by :func:`schedule_from_orders`); arguments as there."""
    table, orders = interleaved_orders(
        n_ranks, stages_per_rank, n_microbatches, microbatch_group_size=microbatch_group_size
    )
    return schedule_from_orders(table, orders, n_microbatches, stages_per_rank)
