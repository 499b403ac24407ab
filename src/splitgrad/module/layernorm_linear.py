"""``splitgrad.LayerNormLinear``: ``y = norm(x) @ W.T + b`` whose backward can defer the linear's wgrad."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..core import SplitModule, split_backward
from ..distributed.tp_config import shard_size, tensor_parallel_config
from ..distributed.tp_sequence import gather_sequence
from ..functional.init import linear_init_
from ..functional.norm import check_normalization, init_norm_
from ..functional.split_sizes import check_positive_sizes
from ._fused_norm import fused_norm_backward, fused_norm_forward
from ._layer_setup import (
    init_norm_settings,
    init_te_settings,
    register_norm_parameters,
    register_optional_parameter,
)
from ._linear_wgrad import hand_over_linear_wgrad, linear_wgrad_parameters, route_wgrad_at_forward
from ._te_keywords import refuse_unsupported_te_keywords, rng_tracker_fork
from ._tp_linear import _TPLinearFunction
from ._tp_norm import module_norm_autograd
from ._tp_params import init_tp_linear_, mark_sequence_parallel, mark_tp_params

__all__ = ["LayerNormLinear"]


class _LayerNormLinearFunction(torch.autograd.Function):
    """Autograd Function of :class:`LayerNormLinear`.

    Shapes: ``x: (..., in)``, ``ln_weight/ln_bias: (in,)``, ``weight: (out, in)``, ``bias: (out,) | None`` ->
    ``y: (..., out)`` and, with ``return_layernorm_output``, ``ln_out: (..., in)``. The norm's gradients are
    returned to autograd in every mode; only ``weight``/``bias`` go through ``owner.hand_over_wgrad``.
    """

    @staticmethod
    def forward(ctx, x, ln_weight, ln_bias, weight, bias, owner: LayerNormLinear):  # type: ignore[override]
        route_wgrad_at_forward(ctx, owner, (owner.weight, owner.bias), has_bias=bias is not None)
        ctx.return_ln = owner.return_layernorm_output
        ctx.set_materialize_grads(False)
        x2, gamma, ln_out, stats = fused_norm_forward(ctx, owner, x, ln_weight, ln_bias)
        ctx.n_stats = len(stats)
        ctx.save_for_backward(x2, ln_out, gamma, ln_bias, weight, *stats)
        y = F.linear(ln_out, weight, bias).view(*x.shape[:-1], weight.shape[0])
        if ctx.return_ln:
            return y, ln_out.view(x.shape)
        return y

    @staticmethod
    @split_backward
    def backward(ctx, dy, dln_extra=None):  # type: ignore[override]
        x2, ln_out, gamma, ln_bias, weight, *stats = ctx.saved_tensors
        owner: LayerNormLinear = ctx.owner
        if dy is None:
            # Only ln_out reached the loss; the linear still owes (zero) gradients so pending work stays in step.
            dy2 = ln_out.new_zeros(ln_out.shape[0], weight.shape[0])
        else:
            dy2 = dy.reshape(-1, dy.shape[-1])

        want_x, want_g, want_beta = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        dx = dg = dbeta = None
        if want_x or want_g or want_beta:
            dln = dy2.mm(weight)
            if dln_extra is not None:
                dln = dln + dln_extra.reshape(dln.shape)
            dx, dg, dbeta = fused_norm_backward(
                ctx, dln, x2, stats, gamma, ln_bias, (want_x, want_g, want_beta)
            )

        dw, db = hand_over_linear_wgrad(owner, ctx, dy2, ln_out, ctx.needs_input_grad[3:5])
        return dx, dg, dbeta, dw, db, None


class LayerNormLinear(SplitModule):
    """LayerNorm (or RMSNorm) followed by a linear layer, with a splittable backward (TE's module and names).

    The norm's gradients (``layer_norm_weight``, ``layer_norm_bias``) come in the main backward like any
    module's; only the linear's ``weight``/``bias`` gradients are deferred (``delay_wgrad_compute``) or
    written into ``weight.main_grad`` (``fuse_wgrad_accumulation``).

    Args:
        in_features: size of the last input dimension (the normalised one).
        out_features: size of the last output dimension.
        eps: added to the variance (LayerNorm) or mean square (RMSNorm).
        bias: learn the linear's additive bias.
        normalization: ``"LayerNorm"`` or ``"RMSNorm"`` (``x * rsqrt(mean(x^2) + eps) * gamma``, no bias).
        zero_centered_gamma: the scale applied is ``1 + layer_norm_weight`` (initialised to zeros).
        return_layernorm_output: ``forward`` returns ``(y, ln_out)``, both differentiable (under sequence
            parallelism ``ln_out`` is this rank's sequence shard, before the all-gather).
        tp_group, tp_size, sequence_parallel, return_bias, init_method, sp_wgrad_input: as
            :class:`~splitgrad.Linear`; the norm runs on the local activation (its sequence shard under
            sequence parallelism, where ``layer_norm_weight``/``layer_norm_bias`` carry
            ``sequence_parallel = True``) and its gradients flow through autograd.
        parallel_mode: None or ``"column"`` (TE supports only these here).
        delay_wgrad_compute: park the linear's weight gradient for :meth:`backward_dw`.
        fuse_wgrad_accumulation: add the linear's weight gradient into ``weight.main_grad``.
        params_dtype: parameter dtype (default: torch's default dtype).
        device: parameter device.
        return_layernorm_output_gathered: with ``return_layernorm_output`` under sequence parallelism, the
            returned norm output is all-gathered to ``(s, b, in_features)`` (its gradient reduce-scattered back);
            otherwise no effect (TE's meaning).
        get_rng_state_tracker, name: as :class:`~splitgrad.Linear`.
        parameters_split, symmetric_ar_type, ub_overlap_ag, ub_overlap_rs, ub_overlap_rs_dgrad, ub_bulk_dgrad,
            ub_bulk_wgrad: accepted at TE's default only; ub_name: accepted, no effect. Every TE keyword:
            docs/modules.md.

    Shapes: input ``(..., in_features)`` -> output ``(..., out_features)``.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        eps: float = 1e-5,
        bias: bool = True,
        *,
        normalization: str = "LayerNorm",
        zero_centered_gamma: bool = False,
        return_layernorm_output: bool = False,
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
        return_layernorm_output_gathered: bool = False,
        get_rng_state_tracker: Callable[[], object] | None = None,
        name: str | None = None,
        parameters_split: object = None,
        symmetric_ar_type: str | None = None,
        ub_overlap_ag: bool = False,
        ub_overlap_rs: bool = False,
        ub_overlap_rs_dgrad: bool = False,
        ub_bulk_dgrad: bool = False,
        ub_bulk_wgrad: bool = False,
        ub_name: str | None = None,
    ) -> None:
        super().__init__()
        check_positive_sizes("LayerNormLinear", in_features=in_features, out_features=out_features)
        owner = f"LayerNormLinear({in_features}, {out_features})"
        refuse_unsupported_te_keywords("LayerNormLinear", owner, locals())
        self.return_layernorm_output_gathered = bool(return_layernorm_output_gathered)
        check_normalization("LayerNormLinear", normalization)
        init_norm_settings(
            self,
            "LayerNormLinear",
            normalization=normalization,
            eps=eps,
            zero_centered_gamma=zero_centered_gamma,
        )
        self.in_features = in_features
        self.out_features = out_features
        self.return_layernorm_output = bool(return_layernorm_output)
        init_te_settings(
            self, "LayerNormLinear", name=name, return_bias=return_bias, sp_wgrad_input=sp_wgrad_input,
            init_method=init_method, rng=(get_rng_state_tracker, None),
        )  # fmt: skip
        self.tp = tensor_parallel_config(
            tp_group=tp_group, tp_size=tp_size, parallel_mode=parallel_mode,
            sequence_parallel=sequence_parallel, owner=owner, allowed_modes=(None, "column"),
        )  # fmt: skip
        if self.tp.splits:
            out_features = shard_size(out_features, self.tp, owner=owner, name="out_features")
        factory = {"dtype": params_dtype, "device": device}
        register_norm_parameters(self, in_features, factory)
        self.weight = nn.Parameter(torch.empty(out_features, in_features, **factory))
        register_optional_parameter(self, "bias", bias, (out_features,), factory)
        self.reset_parameters()
        mark_tp_params(self.tp, self.weight, self.bias)
        mark_sequence_parallel(self.tp, self.layer_norm_weight, self.layer_norm_bias)
        self.init_split(
            delay_wgrad_compute=delay_wgrad_compute, fuse_wgrad_accumulation=fuse_wgrad_accumulation
        )

    def reset_parameters(self) -> None:
        """Norm: gamma ones (zeros when zero-centered), beta zeros; linear: ``torch.nn.Linear``'s init."""
        init_norm_(self.layer_norm_weight, self.layer_norm_bias, self.zero_centered_gamma)
        with rng_tracker_fork(*self._rng):
            if self._init_method is None:
                linear_init_(self.weight, self.bias)
            else:
                init_tp_linear_("column", self.weight, self.bias, self.in_features, self._init_method)

    def forward(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``x: (..., in_features)`` -> ``(..., out_features)`` (and ``ln_out: (..., in_features)``).

        With ``return_bias=True`` the bias is not added and comes last: ``(y, bias)`` / ``(y, ln_out, bias)``.
        Column-parallel shapes: output ``(..., out_features // tp)``; under sequence parallelism the input is
        ``(s / tp, b, in_features)`` and the output ``(s, b, out_features // tp)``.
        """
        self._check_last_dim(x, self.in_features, "in_features")
        bias = None if self.return_bias else self.bias
        if self.tp.splits:
            ln_out = module_norm_autograd(self, x)
            y = self.apply_function(_TPLinearFunction, ln_out, self.weight, bias, self)
            if self.return_layernorm_output and self.return_layernorm_output_gathered:
                # TE hands out the gathered copy its GEMM used; here it is gathered once more (a second
                # all-gather in forward, a reduce-scatter of its gradient in backward).
                ln_out = gather_sequence(ln_out, self.tp, partial_grad=True)
            out = (y, ln_out) if self.return_layernorm_output else y
        else:
            out = self.apply_function(
                _LayerNormLinearFunction,
                x,
                self.layer_norm_weight,
                self.layer_norm_bias,
                self.weight,
                bias,
                self,
            )
        if not self.return_bias:
            return out
        return (*out, self.bias) if isinstance(out, tuple) else (out, self.bias)

    def wgrad_parameters(self) -> list[nn.Parameter]:
        return linear_wgrad_parameters(self)

    def extra_repr(self) -> str:
        text = f"name={self.name!r}, " if self.name is not None else ""
        text += (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"normalization={self.normalization}"
        )
        if self.tp.splits:
            text += f", parallel_mode='column', tp_size={self.tp.size}, sequence_parallel={self.tp.sequence_parallel}"
        return text
