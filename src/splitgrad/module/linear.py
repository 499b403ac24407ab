"""``splitgrad.Linear``: ``y = x @ W.T + b`` whose backward can defer the weight gradient."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..core import SplitModule, split_backward
from ..distributed.tp_config import TensorParallelConfig, shard_size, tensor_parallel_config
from ..functional.init import linear_init_
from ..functional.split_sizes import check_positive_sizes
from ._layer_setup import init_te_settings
from ._linear_wgrad import hand_over_linear_wgrad, linear_wgrad_parameters, route_wgrad_at_forward
from ._te_keywords import refuse_unsupported_te_keywords, rng_tracker_fork
from ._tp_linear import _TPLinearFunction
from ._tp_params import init_tp_linear_, mark_tp_params

__all__ = ["Linear"]


class _LinearFunction(torch.autograd.Function):
    """Autograd Function of :class:`Linear`; backward splits dgrad from wgrad through ``owner``.

    Shapes: ``x: (..., in)``, ``weight: (out, in)``, ``bias: (out,) | None`` -> ``y: (..., out)``.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, owner: Linear):  # type: ignore[override]
        route_wgrad_at_forward(ctx, owner, (owner.weight, owner.bias), has_bias=bias is not None)
        ctx.save_for_backward(x, weight)
        return F.linear(x, weight, bias)

    @staticmethod
    @split_backward
    def backward(ctx, dy):  # type: ignore[override]
        x, weight = ctx.saved_tensors
        owner: Linear = ctx.owner
        dy2 = dy.reshape(-1, dy.shape[-1])
        x2 = x.reshape(-1, x.shape[-1])
        dx = dy2.mm(weight).view(x.shape) if ctx.needs_input_grad[0] else None

        dw, db = hand_over_linear_wgrad(owner, ctx, dy2, x2, ctx.needs_input_grad[1:3])
        return dx, dw, db, None


class Linear(SplitModule):
    """Drop-in ``torch.nn.Linear`` (same parameters, init and state_dict) with a splittable backward.

    Args:
        in_features: size of the last input dimension (of the whole layer, as in TE).
        out_features: size of the last output dimension (of the whole layer).
        bias: learn an additive bias.
        tp_group: tensor-parallel process group (None: one rank, today's layer bit for bit).
        tp_size: expected size of ``tp_group`` (checked); without a group only 1.
        parallel_mode: ``"column"`` (weight ``(out/tp, in)``, output sharded on the last dim), ``"row"``
            (weight ``(out, in/tp)``, input sharded on the last dim, output all-reduced, replicated bias added
            after the reduction) or None (not split).
        sequence_parallel: activations outside the layer are sharded on dim 0 (sequence-first ``(s, b, h)``):
            column all-gathers its input in forward and reduce-scatters the input gradient; row
            reduce-scatters its output. The row bias then carries ``sequence_parallel = True`` (its gradient
            is partial; Megatron all-reduces such parameters over the TP group).
        return_bias: return ``(output, bias)`` without adding the bias (TE's fusion hook); the bias gradient
            then flows through autograd.
        init_method: ``init_method(weight)`` initialises this rank's **local** weight shard (as TE); the bias
            is then zeroed. Default: ``torch.nn.Linear``'s initialisation (with the whole layer's fan-in);
            a replicated row-parallel bias starts at zero so that all TP ranks agree.
        sp_wgrad_input: deferred W under column sequence parallelism keeps the gathered input until W
            (``"keep"``) or only the local shard, all-gathering it again in ``backward_dw`` (``"regather"``,
            a collective: every TP rank must run its W work in the same order). See docs/tensor_parallel.md.
        delay_wgrad_compute: backward computes only the input gradient; the weight/bias gradient is parked as a
            task and computed by :meth:`backward_dw` (or by a :func:`splitgrad.capture_wgrad` bundle).
        fuse_wgrad_accumulation: add the weight gradient straight into ``weight.main_grad`` (the fp32 buffer of
            a data-parallel wrapper) with one addmm; ``weight.grad`` stays None. The bias gradient still goes
            to ``bias.grad``.
        params_dtype: parameter dtype (default: torch's default dtype).
        device: parameter device.
        get_rng_state_tracker: initialise the parameters inside ``get_rng_state_tracker().fork()`` (TE's;
            Megatron's tracker seeds its model-parallel state per TP rank, so weight shards differ).
        rng_tracker_name: the name passed to ``fork`` (None: the tracker's default).
        name: the module's name, shown in its repr and error messages.
        parameters_split, symmetric_ar_type, ub_overlap_ag, ub_overlap_rs, ub_overlap_rs_dgrad, ub_bulk_dgrad,
            ub_bulk_wgrad: accepted at TE's default only (``ValueError`` otherwise, saying what to use).
        ub_name, save_original_input: accepted, no effect (no userbuffers, no quantization).
            Every TE keyword: docs/modules.md.

    Shapes: input ``(..., in_features)`` -> output ``(..., out_features)``.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        tp_group: torch.distributed.ProcessGroup | None = None,
        tp_size: int | None = None,
        parallel_mode: str | None = None,
        sequence_parallel: bool = False,
        return_bias: bool = False,
        init_method: Callable[[torch.Tensor], object] | None = None,
        delay_wgrad_compute: bool = False,
        fuse_wgrad_accumulation: bool = False,
        params_dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        sp_wgrad_input: str = "keep",
        get_rng_state_tracker: Callable[[], object] | None = None,
        rng_tracker_name: str | None = None,
        name: str | None = None,
        parameters_split: object = None,
        symmetric_ar_type: str | None = None,
        save_original_input: bool = False,
        ub_overlap_ag: bool = False,
        ub_overlap_rs: bool = False,
        ub_overlap_rs_dgrad: bool = False,
        ub_bulk_dgrad: bool = False,
        ub_bulk_wgrad: bool = False,
        ub_name: str | None = None,
    ) -> None:
        super().__init__()
        check_positive_sizes("Linear", in_features=in_features, out_features=out_features)
        refuse_unsupported_te_keywords("Linear", f"Linear({in_features}, {out_features})", locals())
        init_te_settings(
            self, "Linear", name=name, return_bias=return_bias, sp_wgrad_input=sp_wgrad_input,
            init_method=init_method, rng=(get_rng_state_tracker, rng_tracker_name),
        )  # fmt: skip
        self.in_features = in_features
        self.out_features = out_features
        self.tp = tensor_parallel_config(
            tp_group=tp_group, tp_size=tp_size, parallel_mode=parallel_mode,
            sequence_parallel=sequence_parallel, owner=f"Linear({in_features}, {out_features})",
        )  # fmt: skip
        out_local, in_local = _local_shape(self.tp, in_features, out_features)
        factory = {"dtype": params_dtype, "device": device}
        self.weight = nn.Parameter(torch.empty(out_local, in_local, **factory))
        bias_size = out_local if self.tp.parallel_mode == "column" else out_features
        self.bias = nn.Parameter(torch.empty(bias_size, **factory)) if bias else None
        self.reset_parameters()
        mark_tp_params(self.tp, self.weight, self.bias)
        self.init_split(
            delay_wgrad_compute=delay_wgrad_compute, fuse_wgrad_accumulation=fuse_wgrad_accumulation
        )

    def reset_parameters(self) -> None:
        """``torch.nn.Linear``'s initialisation (or ``init_method``), so seeded models match it exactly.

        With ``get_rng_state_tracker`` all of it runs inside the tracker's ``fork`` (as TE).
        """
        with rng_tracker_fork(*self._rng):
            if self._init_method is None and not self.tp.splits:
                linear_init_(self.weight, self.bias)
            else:
                init_tp_linear_(
                    self.tp.parallel_mode if self.tp.splits else None,
                    self.weight,
                    self.bias,
                    self.in_features,
                    self._init_method,
                )

    def forward(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]:
        """``x: (..., in_features)`` -> ``(..., out_features)``; sharded shapes: docs/tensor_parallel.md.

        Returns ``(output, bias)`` with ``return_bias=True``.
        """
        bias = None if self.return_bias else self.bias
        if self.tp.splits:
            self._check_last_dim(x, self.weight.shape[1], "in_features // tp_size (local)")
            y = self.apply_function(_TPLinearFunction, x, self.weight, bias, self)
        else:
            self._check_last_dim(x, self.in_features, "in_features")
            y = self.apply_function(_LinearFunction, x, self.weight, bias, self)
        return (y, self.bias) if self.return_bias else y

    def wgrad_parameters(self) -> list[nn.Parameter]:
        return linear_wgrad_parameters(self)

    def extra_repr(self) -> str:
        text = f"name={self.name!r}, " if self.name is not None else ""
        text += (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
        )
        if self.tp.splits:
            text += f", parallel_mode={self.tp.parallel_mode!r}, tp_size={self.tp.size}"
            text += f", sequence_parallel={self.tp.sequence_parallel}"
        return text


def _local_shape(cfg: TensorParallelConfig, in_features: int, out_features: int) -> tuple[int, int]:
    owner = f"Linear({in_features}, {out_features})"
    if cfg.splits and cfg.parallel_mode == "column":
        return shard_size(out_features, cfg, owner=owner, name="out_features"), in_features
    if cfg.splits and cfg.parallel_mode == "row":
        return out_features, shard_size(in_features, cfg, owner=owner, name="in_features")
    return out_features, in_features
