"""The input a column-parallel layer's W needs under sequence parallelism, shared by ``Linear`` and
``LayerNormMLP`` (fc1): the all-gathered input, gathered while the dgrad GEMMs run, or — with
``sp_wgrad_input="regather"`` and a deferred W — the local shard, gathered again when W runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..distributed.tp_comm import PendingCollective, all_gather_dim0

__all__ = ["WgradInput"]


class WgradInput:
    """Start, at the top of a column-parallel backward, whatever gather W's input needs.

    Args:
        owner: the layer (``tp``, ``sp_wgrad_input``, ``tp_comm_overlap``, ``need_backward_dw()``).
        ctx: the autograd context (``ctx.split``: this backward defers its W).
        x: the layer's local input ``(s/tp, b, in)`` under sequence parallelism, else ``(..., in)``.
        needed: whether the weight gradient is wanted at all (nothing is gathered otherwise).
    """

    def __init__(self, owner: Any, ctx: Any, x: torch.Tensor, needed: bool) -> None:
        cfg = owner.tp
        self._x, self._cfg = x, cfg
        self._regather = bool(
            cfg.sequence_parallel
            and owner.sp_wgrad_input == "regather"
            and ctx.split
            and owner.need_backward_dw()
        )
        self._gather: PendingCollective | None = None
        if cfg.sequence_parallel and needed and not self._regather:
            # Overlapped with the dgrad GEMMs that follow unless overlap is off (then waited here, in order).
            self._gather = all_gather_dim0(x, cfg, async_op=True)
            if not owner.tp_comm_overlap:
                self._gather.wait()

    def resolve(self) -> tuple[Callable[[], torch.Tensor], torch.Tensor]:
        """After the dgrad GEMMs: ``(x_w, saved)`` — ``x_w()`` returns W's input as ``(tokens, in)``
        (gathering the shard now when regathering), ``saved`` is the tensor a deferred W task keeps alive."""
        if self._gather is not None:
            x_full = saved = self._gather.wait()
        elif self._regather:
            x_full, saved = None, self._x
        else:
            x_full = saved = self._x
        x, cfg = self._x, self._cfg

        def x_w() -> torch.Tensor:
            full = x_full if x_full is not None else all_gather_dim0(x, cfg).wait()
            return full.reshape(-1, full.shape[-1])

        return x_w, saved
