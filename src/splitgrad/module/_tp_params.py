"""Initialisation and Megatron's attributes for tensor-parallel parameters (shared by the TP modules)."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from ..distributed.tp_config import TensorParallelConfig
from ..functional.init import linear_init_

__all__ = ["init_tp_linear_", "mark_sequence_parallel", "mark_tp_params"]


@torch.no_grad()
def init_tp_linear_(
    parallel_mode: str | None,
    weight: nn.Parameter,
    bias: nn.Parameter | None,
    in_features: int,
    init_method: Callable[[torch.Tensor], object] | None,
) -> None:
    """Initialise a (possibly sharded, ``parallel_mode``) linear's ``weight`` and ``bias``.

    ``init_method(weight)`` gets this rank's local shard (TE's meaning) and the bias is zeroed. Without it:
    ``torch.nn.Linear``'s distribution with the whole layer's fan-in ``in_features`` (a row shard has fewer
    columns than the layer's fan-in); a bias replicated over the TP group (row-parallel) starts at zero so
    every rank holds the same one without a broadcast, as in TE and Megatron.
    """
    if init_method is not None:
        init_method(weight)
        if bias is not None:
            bias.zero_()
        return
    if parallel_mode != "row":
        linear_init_(weight, bias)  # the local shard's fan-in is the layer's
        return
    bound = 1 / math.sqrt(in_features)
    weight.uniform_(-bound, bound)
    if bias is not None:
        bias.zero_()


def mark_tp_params(
    cfg: TensorParallelConfig,
    weight: nn.Parameter,
    bias: nn.Parameter | None,
    parallel_mode: str | None = None,
) -> None:
    """Set the attributes Megatron-style code reads on tensor-parallel parameters.

    Sharded ones get ``tensor_model_parallel = True``, ``partition_dim`` (0 column, 1 row) and
    ``partition_stride = 1``; a replicated row bias under sequence parallelism gets ``sequence_parallel =
    True`` (its gradient is a partial sum over the local sequence shard: all-reduce it over the TP group).
    Nothing is set on a layer that is not split. ``parallel_mode`` overrides ``cfg``'s (``LayerNormMLP``'s
    fc2 is row-parallel in a column-configured module).
    """
    if not cfg.splits:
        return
    mode = parallel_mode or cfg.parallel_mode
    dim = 0 if mode == "column" else 1
    for param, sharded in ((weight, True), (bias, mode == "column")):
        if param is None:
            continue
        param.tensor_model_parallel = sharded
        if sharded:
            param.partition_dim = 0 if param.dim() == 1 else dim
            param.partition_stride = 1
        elif cfg.sequence_parallel:
            param.sequence_parallel = True


def mark_sequence_parallel(cfg: TensorParallelConfig, *params: nn.Parameter | None) -> None:
    """``param.sequence_parallel = True`` on replicated parameters applied to the local sequence shard (norms)."""
    if cfg.sequence_parallel:
        for param in params:
            if param is not None:
                param.sequence_parallel = True
