"""Tensor-parallel collectives with explicit groups, optional asynchrony and timeouts.

The layers call these inside their autograd Functions (to overlap a collective with a GEMM, as TE does), so
they are plain functions returning a :class:`PendingCollective`, not autograd Functions. Sequence-parallel
activations are sequence-first ``(s, b, h)``: gathers and scatters work on dim 0.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .tp_config import TensorParallelConfig
from .wait import bounded_wait

__all__ = [
    "PendingCollective",
    "all_gather_dim0",
    "all_reduce",
    "check_dim0_divisible",
    "reduce_scatter_dim0",
]

# torch >= 2.13 names the single-tensor collectives *_single; older releases only have *_into_tensor / *_tensor.
_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class PendingCollective:
    """A collective's result, ready after :meth:`wait` (at once when it ran synchronously)."""

    __slots__ = ("_cfg", "_result", "_what", "_work")

    def __init__(
        self, result: torch.Tensor, work: dist.Work | None, what: str, cfg: TensorParallelConfig
    ) -> None:
        self._result, self._work, self._what, self._cfg = result, work, what, cfg

    def wait(self) -> torch.Tensor:
        """Block until done and return the result.

        Raises:
            RuntimeError: naming the collective, the rank and the limit (``cfg.timeout_s``), when it failed or
                did not finish in time.
        """
        if self._work is not None:
            work, self._work = self._work, None
            bounded_wait(
                work, f"tensor-parallel {self._what}", timeout=self._cfg.timeout_s, group=self._cfg.group
            )
        return self._result


def check_dim0_divisible(x: torch.Tensor, cfg: TensorParallelConfig, what: str) -> None:
    """``ValueError`` ("{what} divisible by the tensor-parallel size ...") unless ``x: (s, ...)`` splits into
    ``cfg.size`` equal dim-0 blocks."""
    if x.dim() == 0 or x.shape[0] % cfg.size:
        raise ValueError(
            f"{what} divisible by the tensor-parallel size {cfg.size}, got shape {tuple(x.shape)}"
        )


def all_gather_dim0(
    x: torch.Tensor, cfg: TensorParallelConfig, *, async_op: bool = False
) -> PendingCollective:
    """Concatenate every rank's ``x: (s_local, ...)`` on dim 0 -> ``(size * s_local, ...)``, in rank order."""
    x = x.contiguous()
    out = torch.empty((cfg.size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    work = _GATHER(out, x, group=cfg.group, async_op=async_op)
    return PendingCollective(out, work if async_op else None, f"all-gather of {tuple(x.shape)}", cfg)


def reduce_scatter_dim0(
    x: torch.Tensor, cfg: TensorParallelConfig, *, async_op: bool = False
) -> PendingCollective:
    """Sum ``x: (s, ...)`` over the ranks and keep this rank's dim-0 block ``(s // size, ...)``.

    Raises:
        ValueError: ``s`` is not divisible by the group size.
    """
    check_dim0_divisible(x, cfg, "sequence-parallel reduce-scatter needs dim 0")
    x = x.contiguous()
    out = torch.empty((x.shape[0] // cfg.size, *x.shape[1:]), dtype=x.dtype, device=x.device)
    work = _SCATTER(out, x, group=cfg.group, async_op=async_op)
    return PendingCollective(out, work if async_op else None, f"reduce-scatter of {tuple(x.shape)}", cfg)


def all_reduce(x: torch.Tensor, cfg: TensorParallelConfig, *, async_op: bool = False) -> PendingCollective:
    """Sum ``x`` (any shape) over the ranks, in place on a contiguous ``x``; returns it."""
    x = x.contiguous()
    work = dist.all_reduce(x, group=cfg.group, async_op=async_op)
    return PendingCollective(x, work if async_op else None, f"all-reduce of {tuple(x.shape)}", cfg)
