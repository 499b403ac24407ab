"""``splitgrad.LayerNormLinear``: ``y = norm(x) @ W.T + b`` whose backward can defer the linear's wgrad."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..core import SplitModule, split_backward
from ..functional.init import linear_init_
from ..functional.norm import check_normalization, effective_gamma, init_norm_, norm_backward, norm_forward
from ._linear_wgrad import hand_over_linear_wgrad

__all__ = ["LayerNormLinear"]


class _LayerNormLinearFunction(torch.autograd.Function):
    """Autograd Function of :class:`LayerNormLinear`.

    Shapes: ``x: (..., in)``, ``ln_weight/ln_bias: (in,)``, ``weight: (out, in)``, ``bias: (out,) | None`` ->
    ``y: (..., out)`` and, with ``return_layernorm_output``, ``ln_out: (..., in)``. The norm's gradients are
    returned to autograd in every mode; only ``weight``/``bias`` go through ``owner.hand_over_wgrad``.
    """

    @staticmethod
    def forward(ctx, x, ln_weight, ln_bias, weight, bias, owner: LayerNormLinear):  # type: ignore[override]
        ctx.owner = owner
        ctx.has_bias = bias is not None
        ctx.split = owner.splits_wgrad()
        ctx.params = (owner.weight, owner.bias)
        ctx.normalization = owner.normalization
        ctx.return_ln = owner.return_layernorm_output
        ctx.set_materialize_grads(False)
        x2 = x.reshape(-1, x.shape[-1])
        gamma = effective_gamma(ln_weight, owner.zero_centered_gamma)
        ln_out, stats = norm_forward(x2, gamma, ln_bias, normalization=owner.normalization, eps=owner.eps)
        ctx.n_stats = len(stats)
        ctx.save_for_backward(x2, ln_out, gamma, ln_bias, weight, *stats)
        ctx.x_shape = x.shape
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
            dx, dg, dbeta = norm_backward(
                dln, x2, tuple(stats), gamma, ln_bias,
                normalization=ctx.normalization, output_mask=(want_x, want_g, want_beta),
            )  # fmt: skip
            if dx is not None:
                dx = dx.view(ctx.x_shape)

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
        return_layernorm_output: ``forward`` returns ``(y, ln_out)``, both differentiable.
        delay_wgrad_compute: park the linear's weight gradient for :meth:`backward_dw`.
        fuse_wgrad_accumulation: add the linear's weight gradient into ``weight.main_grad``.
        params_dtype: parameter dtype (default: torch's default dtype).
        device: parameter device.

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
        delay_wgrad_compute: bool = False,
        fuse_wgrad_accumulation: bool = False,
        params_dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        if in_features <= 0 or out_features <= 0:
            raise ValueError(f"LayerNormLinear needs positive sizes, got {in_features=} {out_features=}")
        check_normalization("LayerNormLinear", normalization)
        if eps < 0:
            raise ValueError(f"LayerNormLinear: eps must be >= 0, got {eps=}")
        self.in_features = in_features
        self.out_features = out_features
        self.eps = float(eps)
        self.normalization = normalization
        self.zero_centered_gamma = bool(zero_centered_gamma)
        self.return_layernorm_output = bool(return_layernorm_output)
        factory = {"dtype": params_dtype, "device": device}
        self.layer_norm_weight = nn.Parameter(torch.empty(in_features, **factory))
        if normalization == "LayerNorm":
            self.layer_norm_bias = nn.Parameter(torch.empty(in_features, **factory))
        else:
            self.register_parameter("layer_norm_bias", None)
        self.weight = nn.Parameter(torch.empty(out_features, in_features, **factory))
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, **factory))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()
        self.init_split(
            delay_wgrad_compute=delay_wgrad_compute, fuse_wgrad_accumulation=fuse_wgrad_accumulation
        )

    def reset_parameters(self) -> None:
        """Norm: gamma ones (zeros when zero-centered), beta zeros; linear: ``torch.nn.Linear``'s init."""
        init_norm_(self.layer_norm_weight, self.layer_norm_bias, self.zero_centered_gamma)
        linear_init_(self.weight, self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``x: (..., in_features)`` -> ``(..., out_features)`` (and ``ln_out: (..., in_features)``)."""
        self._check_last_dim(x, self.in_features, "in_features")
        return self.apply_function(
            _LayerNormLinearFunction,
            x,
            self.layer_norm_weight,
            self.layer_norm_bias,
            self.weight,
            self.bias,
            self,
        )

    def wgrad_parameters(self) -> list[nn.Parameter]:
        return [self.weight] if self.bias is None else [self.weight, self.bias]

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"normalization={self.normalization}"
        )
