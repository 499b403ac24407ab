"""The tensor-parallel autograd Function of ``splitgrad.LayerNormMLP``: fc1 column-parallel, fc2 row-parallel.

Input: the normalised activation ``ln_out: (..., hidden)`` (its sequence shard ``(s/tp, b, hidden)`` under
sequence parallelism, all-gathered here); fc1 ``(F1/tp, hidden)`` holds this rank's rows of BOTH halves of a
gated activation (``[a_r; b_r]``), so the local ``chunk(2)`` pairs the right gate with its value; fc2
``(hidden, ffn/tp)``; the partial output is all-reduced (reduce-scattered on dim 0 under sequence parallelism)
and the replicated fc2 bias added after. Both fcs' weight gradients are ONE task per backward, as in the
single-process module; the input the fc1 wgrad needs is kept or re-gathered as ``owner.sp_wgrad_input`` says.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ..core import split_backward
from ..distributed.tp_comm import PendingCollective, all_gather_dim0, all_reduce, reduce_scatter_dim0
from ..distributed.tp_config import TensorParallelConfig
from ..functional.activations import activation_backward, activation_forward
from ..functional.wgrad import accumulate_grad, bias_wgrad, check_targets, linear_wgrad, write_linear_wgrad
from ._tp_wgrad_input import WgradInput

__all__: list[str] = []  # the Function is private to LayerNormMLP


class _TPMLPFunction(torch.autograd.Function):
    """``fc2(act(fc1(ln_out)))`` over ``owner.tp``; shapes in the module docstring."""

    @staticmethod
    def forward(ctx, ln_out, fc1_w, fc1_b, fc2_w, fc2_b, owner):  # type: ignore[override]
        cfg: TensorParallelConfig = owner.tp
        ctx.owner, ctx.split, ctx.activation = owner, owner.splits_wgrad(), owner.activation
        ctx.params = (
            owner.fc1_weight,
            owner.fc1_bias,
            owner.fc2_weight,
            owner.fc2_bias if fc2_b is not None else None,
        )
        x_full = all_gather_dim0(ln_out, cfg).wait() if cfg.sequence_parallel else ln_out
        h = F.linear(x_full.reshape(-1, x_full.shape[-1]), fc1_w, fc1_b)
        act_out, extra = activation_forward(h, owner.activation)
        partial = F.linear(act_out, fc2_w).view(*x_full.shape[:-1], fc2_w.shape[0])
        y = (reduce_scatter_dim0 if cfg.sequence_parallel else all_reduce)(partial, cfg).wait()
        ctx.save_for_backward(ln_out, fc1_w, fc2_w, h, act_out, extra)
        return y if fc2_b is None else y + fc2_b

    @staticmethod
    @split_backward
    def backward(ctx, dy):  # type: ignore[override]
        ln_out, fc1_w, fc2_w, h, act_out, extra = ctx.saved_tensors
        owner = ctx.owner
        cfg: TensorParallelConfig = owner.tp
        need = ctx.needs_input_grad
        want = (need[1], need[2], need[3], need[4])
        dy_b = dy.reshape(-1, dy.shape[-1])
        dy_full = all_gather_dim0(dy, cfg).wait() if cfg.sequence_parallel else dy
        dy2 = dy_full.reshape(-1, dy_full.shape[-1])
        # fc1's wgrad needs the gathered input: gather it while the dgrad GEMMs run (unless W regathers it).
        w_input = WgradInput(owner, ctx, ln_out, need[1])
        dh = None
        if need[0] or need[1] or need[2]:
            dh = activation_backward(dy2.mm(fc2_w), h, act_out, extra, ctx.activation)
        reduction: PendingCollective | None = None
        if need[0]:
            dln = dh.mm(fc1_w).view(*dy_full.shape[:-1], ln_out.shape[-1])
            reduction = (reduce_scatter_dim0 if cfg.sequence_parallel else all_reduce)(
                dln, cfg, async_op=True
            )
            if not owner.tp_comm_overlap:
                reduction.wait()
        x1, saved_x = w_input.resolve()

        dh_task = dh if (need[1] or need[2]) else None  # a frozen fc1 keeps nothing alive until W

        def gradients(mask: tuple[bool, ...]) -> list[torch.Tensor | None]:
            return [
                linear_wgrad(dh, x1()) if mask[0] else None, bias_wgrad(dh) if mask[1] else None,
                linear_wgrad(dy2, act_out) if mask[2] else None, bias_wgrad(dy_b) if mask[3] else None,
            ]  # fmt: skip

        def write(mask: tuple[bool, ...]) -> None:
            _write(owner, mask, dy2, dy_b, act_out, dh_task, x1)

        saved = [dy2, act_out] + ([dy_b] if cfg.sequence_parallel else [])
        saved += [] if dh_task is None else [dh_task, saved_x]
        dw1, db1, dw2, db2 = owner.hand_over_wgrad(
            ctx.params, want, split=ctx.split, gradients=gradients, write=write, saved=saved,
            create_graph=ctx.create_graph,
        )  # fmt: skip
        dx = reduction.wait() if reduction is not None else None
        return dx, dw1, db1, dw2, db2, None


def _write(owner: Any, mask, dy2, dy_b, act_out, dh, x1) -> None:
    """Write fc2's then fc1's gradients after checking all four targets (a failed task writes nothing)."""
    name, fused = owner._describe(), owner.fuse_wgrad_accumulation
    fc2_bias = owner.fc2_bias if mask[3] else None
    check_targets(
        [
            (owner.fc2_weight, mask[2], "fc2_weight", fused), (fc2_bias, mask[3], "fc2_bias", False),
            (owner.fc1_weight, dh is not None and mask[0], "fc1_weight", fused),
            (owner.fc1_bias, dh is not None and mask[1], "fc1_bias", False),
        ],
        owner=name,
    )  # fmt: skip
    if mask[2]:
        write_linear_wgrad(
            owner.fc2_weight, None, dy2, act_out, want_w=True, want_b=False, fused=fused, owner=name,
            name="fc2_weight",
        )  # fmt: skip
    if mask[3]:
        accumulate_grad(owner.fc2_bias, bias_wgrad(dy_b))
    if dh is not None and (mask[0] or mask[1]):
        write_linear_wgrad(
            owner.fc1_weight, owner.fc1_bias, dh, x1() if mask[0] else dh, want_w=mask[0], want_b=mask[1],
            fused=fused, owner=name, name="fc1_weight",
        )  # fmt: skip
