"""The tensor-parallel autograd Function of ``splitgrad.Linear`` (``parallel_mode="column"`` / ``"row"``).

Column: ``weight (out/tp, in)``; input full, or with sequence parallelism ``(s/tp, b, in)`` all-gathered on
dim 0 in forward; output ``(..., out/tp)``; the input gradient is all-reduced (reduce-scattered back to the
sequence shard under sequence parallelism). Row: ``weight (out, in/tp)``; input ``(..., in/tp)``; the partial
output is all-reduced (reduce-scattered on dim 0 under sequence parallelism) and the replicated bias added
after the reduction.

Backward overlaps communication with the GEMMs as TE does: the input all-gather the weight gradient needs runs
while the dgrad GEMM computes, and the dgrad reduction runs while the weight gradient computes (immediate
mode) or while later layers' backward runs (deferred mode). The deferred W task under column sequence
parallelism holds either the gathered input (``sp_wgrad_input="keep"``) or only the local shard and gathers
again when it runs (``"regather"``: a collective inside ``backward_dw``, so every TP rank must run its W work
in the same order).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from ..core import SplitModule, split_backward
from ..distributed.tp_comm import PendingCollective, all_gather_dim0, all_reduce, reduce_scatter_dim0
from ..distributed.tp_config import TensorParallelConfig
from ..functional.wgrad import accumulate_grad, bias_wgrad, check_targets, linear_wgrad, write_linear_wgrad
from ._tp_wgrad_input import WgradInput

__all__ = ["SP_WGRAD_INPUTS", "hand_over_tp_wgrad"]

#: What a deferred column-parallel W task keeps under sequence parallelism (see the module docstring).
SP_WGRAD_INPUTS = ("keep", "regather")


def hand_over_tp_wgrad(
    owner: SplitModule,
    ctx: Any,
    dy_w: torch.Tensor,
    x_w: Callable[[], torch.Tensor],
    dy_b: torch.Tensor,
    wanted: tuple[bool, bool],
    saved: tuple[torch.Tensor, ...],
) -> list[torch.Tensor | None]:
    """Route ``dW = dy_w.T @ x_w()`` and ``db = dy_b.sum(0)``; like ``hand_over_linear_wgrad`` with two dy.

    Args:
        owner: the layer (``weight``, its ``ctx.params`` bias, ``fuse_wgrad_accumulation``).
        ctx: the Function's context (``params``, ``split``, ``create_graph``).
        dy_w: ``(tokens, out_local)`` output gradient the weight gradient reads.
        x_w: returns ``(tokens, in_local)``, the input the weight gradient reads (may all-gather it: a
            collective, identical on every TP rank).
        dy_b: ``(tokens_b, out_b)`` output gradient the bias gradient reads (the local sequence shard of a
            row-parallel layer under sequence parallelism: a partial gradient, ``bias.sequence_parallel``).
        wanted: ``ctx.needs_input_grad`` of ``(weight, bias)``.
        saved: the tensors the task keeps (version-checked; counted by ``saved_bytes``).

    Returns:
        ``[dweight, dbias]`` for autograd (None where the layer writes them or none is owed).
    """
    weight, bias = ctx.params

    def gradients(mask: tuple[bool, ...]) -> list[torch.Tensor | None]:
        return [linear_wgrad(dy_w, x_w()) if mask[0] else None, bias_wgrad(dy_b) if mask[1] else None]

    def write(mask: tuple[bool, ...]) -> None:
        fused, name = owner.fuse_wgrad_accumulation, owner._describe()
        check_targets([(weight, mask[0], "weight", fused), (bias, mask[1], "bias", False)], owner=name)
        if mask[0]:
            write_linear_wgrad(
                weight, None, dy_w, x_w(), want_w=True, want_b=False, fused=fused, owner=name, name="weight"
            )
        if mask[1]:
            accumulate_grad(bias, bias_wgrad(dy_b))

    return owner.hand_over_wgrad(
        ctx.params, wanted, split=ctx.split, gradients=gradients, write=write, saved=saved,
        create_graph=ctx.create_graph,
    )  # fmt: skip


class _TPLinearFunction(torch.autograd.Function):
    """``y = x @ W.T + b`` split over ``owner.tp`` (a :class:`TensorParallelConfig` with ``splits``).

    Shapes (``tp`` ranks, ``s`` the sequence, dim 0 of sequence-parallel activations): column ``x: (..., in)``
    or ``(s/tp, b, in)`` -> ``(..., out/tp)`` / ``(s, b, out/tp)``; row ``x: (..., in/tp)`` -> ``(..., out)``
    or ``(s/tp, b, out)``.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, owner):  # type: ignore[override]
        cfg: TensorParallelConfig = owner.tp
        ctx.owner, ctx.split = owner, owner.splits_wgrad()
        ctx.params = (owner.weight, owner.bias if bias is not None else None)
        ctx.save_for_backward(x, weight)
        if cfg.parallel_mode == "column":
            x_full = all_gather_dim0(x, cfg).wait() if cfg.sequence_parallel else x
            return F.linear(x_full, weight, bias)
        partial = F.linear(x, weight)
        reduce = reduce_scatter_dim0 if cfg.sequence_parallel else all_reduce
        y = reduce(partial, cfg).wait()
        return y if bias is None else y + bias

    @staticmethod
    @split_backward
    def backward(ctx, dy):  # type: ignore[override]
        x, weight = ctx.saved_tensors
        owner = ctx.owner
        if owner.tp.parallel_mode == "column":
            return _column_backward(ctx, owner, x, weight, dy)
        return _row_backward(ctx, owner, x, weight, dy)


def _column_backward(ctx: Any, owner: Any, x: torch.Tensor, weight: torch.Tensor, dy: torch.Tensor) -> tuple:
    cfg: TensorParallelConfig = owner.tp
    overlap = owner.tp_comm_overlap
    dy2 = dy.reshape(-1, dy.shape[-1])
    want_dx = ctx.needs_input_grad[0]
    want_w = ctx.needs_input_grad[1:3]
    # Gather the input for W now (overlapping the dgrad GEMM) unless a deferred task will regather it at W.
    w_input = WgradInput(owner, ctx, x, any(want_w))
    reduction: PendingCollective | None = None
    if want_dx:
        dx_full = dy2.mm(weight)
        if cfg.sequence_parallel:
            dx_full = dx_full.view(*dy.shape[:-1], x.shape[-1])
            reduction = reduce_scatter_dim0(dx_full, cfg, async_op=True)
        else:
            reduction = all_reduce(dx_full.view(x.shape), cfg, async_op=True)
        if not overlap:
            reduction.wait()

    x_w, saved_x = w_input.resolve()
    dw, db = hand_over_tp_wgrad(owner, ctx, dy2, x_w, dy2, want_w, saved=(dy2, saved_x))
    dx = reduction.wait() if reduction is not None else None
    return dx, dw, db, None


def _row_backward(ctx: Any, owner: Any, x: torch.Tensor, weight: torch.Tensor, dy: torch.Tensor) -> tuple:
    cfg: TensorParallelConfig = owner.tp
    dy_b = dy.reshape(-1, dy.shape[-1])
    # The row layer's dgrad and wgrad both need the full-sequence output gradient: nothing to overlap it with.
    dy_full = all_gather_dim0(dy, cfg).wait() if cfg.sequence_parallel else dy
    dy2 = dy_full.reshape(-1, dy_full.shape[-1])
    x2 = x.reshape(-1, x.shape[-1])
    dx = dy2.mm(weight).view(x.shape) if ctx.needs_input_grad[0] else None
    saved = (dy2, x2, dy_b) if cfg.sequence_parallel else (dy2, x2)
    dw, db = hand_over_tp_wgrad(owner, ctx, dy2, lambda: x2, dy_b, ctx.needs_input_grad[1:3], saved=saved)
    return dx, dw, db, None
