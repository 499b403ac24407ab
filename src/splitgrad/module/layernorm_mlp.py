"""``splitgrad.LayerNormMLP``: ``fc2(act(fc1(norm(x))))`` whose backward can defer both fc wgrads as one task."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..core import SplitModule, split_backward
from ..functional.activations import activation_backward, activation_forward, check_activation, is_gated
from ..functional.init import linear_init_
from ..functional.norm import check_normalization, effective_gamma, init_norm_, norm_backward, norm_forward
from ..functional.wgrad import bias_wgrad, check_targets, linear_wgrad, write_linear_wgrad

__all__ = ["LayerNormMLP"]


class _LayerNormMLPFunction(torch.autograd.Function):
    """Autograd Function of :class:`LayerNormMLP`.

    Shapes: ``x: (..., hidden)``, ``fc1_weight: (F1, hidden)`` with ``F1 = ffn`` or ``2 * ffn`` (gated),
    ``fc2_weight: (hidden, ffn)`` -> ``y: (..., hidden)``. Both fcs' weight gradients form ONE task per
    backward (whatever is frozen), so one ``backward_dw()`` completes one backward and hooks fire once.
    """

    @staticmethod
    def forward(ctx, x, ln_w, ln_b, fc1_w, fc1_b, fc2_w, fc2_b, owner: LayerNormMLP):  # type: ignore[override]
        ctx.owner = owner
        ctx.has_bias = fc1_b is not None
        ctx.split = owner.splits_wgrad()
        ctx.params = (owner.fc1_weight, owner.fc1_bias, owner.fc2_weight, owner.fc2_bias)
        ctx.normalization = owner.normalization
        ctx.activation = owner.activation
        x2 = x.reshape(-1, x.shape[-1])
        gamma = effective_gamma(ln_w, owner.zero_centered_gamma)
        ln_out, stats = norm_forward(x2, gamma, ln_b, normalization=owner.normalization, eps=owner.eps)
        h = F.linear(ln_out, fc1_w, fc1_b)
        act_out, extra = activation_forward(h, owner.activation)
        y = F.linear(act_out, fc2_w, fc2_b)
        ctx.save_for_backward(x2, ln_out, gamma, ln_b, fc1_w, fc2_w, h, act_out, extra, *stats)
        ctx.x_shape = x.shape
        return y.view(x.shape)

    @staticmethod
    @split_backward
    def backward(ctx, dy):  # type: ignore[override]
        x2, ln_out, gamma, ln_b, fc1_w, fc2_w, h, act_out, extra, *stats = ctx.saved_tensors
        owner: LayerNormMLP = ctx.owner
        need = ctx.needs_input_grad
        dy2 = dy.reshape(-1, dy.shape[-1])
        want_norm = (need[0], need[1], need[2])
        want1 = (need[3], ctx.has_bias and need[4])
        want2 = (need[5], ctx.has_bias and need[6])

        # dgrad chain: fc2 -> activation -> fc1 -> norm.
        dh = None
        if any(want_norm) or any(want1):
            dh = activation_backward(dy2.mm(fc2_w), h, act_out, extra, ctx.activation)
        dx = dg = dbeta = None
        if any(want_norm):
            dx, dg, dbeta = norm_backward(
                dh.mm(fc1_w), x2, tuple(stats), gamma, ln_b,
                normalization=ctx.normalization, output_mask=want_norm,
            )  # fmt: skip
            if dx is not None:
                dx = dx.view(ctx.x_shape)

        def gradients(mask: tuple[bool, ...]) -> list[torch.Tensor | None]:
            return [
                linear_wgrad(dh, ln_out) if mask[0] else None, bias_wgrad(dh) if mask[1] else None,
                linear_wgrad(dy2, act_out) if mask[2] else None, bias_wgrad(dy2) if mask[3] else None,
            ]  # fmt: skip

        # A frozen fc1 owes nothing: do not keep its activation-sized operands alive until backward_dw.
        dh_task = dh if any(want1) else None

        def write(mask: tuple[bool, ...]) -> None:
            owner._write_wgrad(dy2, act_out, dh_task, ln_out, want1=mask[:2], want2=mask[2:])

        saved = (dy2, act_out) if dh_task is None else (dy2, act_out, dh_task, ln_out)
        dw1, db1, dw2, db2 = owner.hand_over_wgrad(
            ctx.params, (*want1, *want2), split=ctx.split, gradients=gradients, write=write,
            saved=saved, create_graph=ctx.create_graph,
        )  # fmt: skip
        return dx, dg, dbeta, dw1, db1, dw2, db2, None


class LayerNormMLP(SplitModule):
    """Norm, fc1, activation, fc2 (TE's module and parameter names) with a splittable backward.

    The norm's gradients come in the main backward; ``fc1_*``/``fc2_*`` gradients are deferred together
    (``delay_wgrad_compute``: one :meth:`backward_dw` completes both fcs of one backward, then the hooks fire
    once) or written at once into ``fc1_weight.main_grad``/``fc2_weight.main_grad``
    (``fuse_wgrad_accumulation``; biases go to ``.grad``).

    Args:
        hidden_size: input and output feature size.
        ffn_hidden_size: the inner size (after the activation).
        eps: the norm's epsilon.
        bias: learn fc1/fc2 biases.
        normalization: ``"LayerNorm"`` or ``"RMSNorm"``.
        activation: ``"gelu"`` (tanh approximation, as TE), ``"relu"``, ``"swiglu"`` (``silu(a) * b``) or
            ``"geglu"`` (``gelu_tanh(a) * b``); the gated ones make fc1 produce ``2 * ffn_hidden_size``
            features split in halves ``[a, b]``.
        zero_centered_gamma: the norm's scale is ``1 + layer_norm_weight`` (initialised to zeros).
        delay_wgrad_compute: park the fcs' weight gradients for :meth:`backward_dw`.
        fuse_wgrad_accumulation: add the fcs' weight gradients into their ``main_grad``.
        params_dtype: parameter dtype (default: torch's default dtype).
        device: parameter device.

    Shapes: input ``(..., hidden_size)`` -> output ``(..., hidden_size)``.
    """

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        eps: float = 1e-5,
        bias: bool = True,
        *,
        normalization: str = "LayerNorm",
        activation: str = "gelu",
        zero_centered_gamma: bool = False,
        delay_wgrad_compute: bool = False,
        fuse_wgrad_accumulation: bool = False,
        params_dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        if hidden_size <= 0 or ffn_hidden_size <= 0:
            raise ValueError(f"LayerNormMLP needs positive sizes, got {hidden_size=} {ffn_hidden_size=}")
        check_normalization("LayerNormMLP", normalization)
        check_activation("LayerNormMLP", activation)
        if eps < 0:
            raise ValueError(f"LayerNormMLP: eps must be >= 0, got {eps=}")
        self.hidden_size = hidden_size
        self.ffn_hidden_size = ffn_hidden_size
        self.eps = float(eps)
        self.normalization = normalization
        self.activation = activation
        self.zero_centered_gamma = bool(zero_centered_gamma)
        factory = {"dtype": params_dtype, "device": device}
        fc1_out = 2 * ffn_hidden_size if is_gated(activation) else ffn_hidden_size
        self.layer_norm_weight = nn.Parameter(torch.empty(hidden_size, **factory))
        if normalization == "LayerNorm":
            self.layer_norm_bias = nn.Parameter(torch.empty(hidden_size, **factory))
        else:
            self.register_parameter("layer_norm_bias", None)
        self.fc1_weight = nn.Parameter(torch.empty(fc1_out, hidden_size, **factory))
        self.fc2_weight = nn.Parameter(torch.empty(hidden_size, ffn_hidden_size, **factory))
        if bias:
            self.fc1_bias = nn.Parameter(torch.empty(fc1_out, **factory))
            self.fc2_bias = nn.Parameter(torch.empty(hidden_size, **factory))
        else:
            self.register_parameter("fc1_bias", None)
            self.register_parameter("fc2_bias", None)
        self.reset_parameters()
        self.init_split(
            delay_wgrad_compute=delay_wgrad_compute, fuse_wgrad_accumulation=fuse_wgrad_accumulation
        )

    def reset_parameters(self) -> None:
        """Identity norm; each fc initialised like a ``torch.nn.Linear`` of the same shape."""
        init_norm_(self.layer_norm_weight, self.layer_norm_bias, self.zero_centered_gamma)
        linear_init_(self.fc1_weight, self.fc1_bias)
        linear_init_(self.fc2_weight, self.fc2_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x: (..., hidden_size)`` -> ``(..., hidden_size)``."""
        self._check_last_dim(x, self.hidden_size, "hidden_size")
        return self.apply_function(
            _LayerNormMLPFunction, x, self.layer_norm_weight, self.layer_norm_bias,
            self.fc1_weight, self.fc1_bias, self.fc2_weight, self.fc2_bias, self,
        )  # fmt: skip

    def wgrad_parameters(self) -> list[nn.Parameter]:
        params = [self.fc1_weight, self.fc1_bias, self.fc2_weight, self.fc2_bias]
        return [p for p in params if p is not None]

    def _write_wgrad(
        self,
        dy2: torch.Tensor,
        act_out: torch.Tensor,
        dh: torch.Tensor | None,
        ln_out: torch.Tensor,
        *,
        want1: tuple[bool, bool],
        want2: tuple[bool, bool],
    ) -> None:
        """Write fc2's then fc1's gradients.

        Args:
            dy2: ``(tokens, hidden)`` output gradient; act_out: ``(tokens, ffn)`` fc2's input.
            dh: ``(tokens, F1)`` fc1's output gradient (None when fc1 owes nothing); ln_out: fc1's input.
            want1, want2: ``(weight, bias)`` owed by fc1 / fc2.
        """
        owner, fused = self._describe(), self.fuse_wgrad_accumulation
        # Both fcs are checked before either is written: a failed task writes nothing and can be retried.
        check_targets(
            [
                (self.fc2_weight, want2[0], "fc2_weight", fused), (self.fc2_bias, want2[1], "fc2_bias", False),
                (self.fc1_weight, dh is not None and want1[0], "fc1_weight", fused),
                (self.fc1_bias, dh is not None and want1[1], "fc1_bias", False),
            ],
            owner=owner, flag="fuse_wgrad_accumulation",
        )  # fmt: skip
        write_linear_wgrad(
            self.fc2_weight, self.fc2_bias, dy2, act_out,
            want_w=want2[0], want_b=want2[1], fused=fused, owner=owner, name="fc2_weight",
        )  # fmt: skip
        if dh is not None:
            write_linear_wgrad(
                self.fc1_weight, self.fc1_bias, dh, ln_out,
                want_w=want1[0], want_b=want1[1], fused=fused, owner=owner, name="fc1_weight",
            )  # fmt: skip

    def extra_repr(self) -> str:
        return (
            f"hidden_size={self.hidden_size}, ffn_hidden_size={self.ffn_hidden_size}, "
            f"bias={self.fc1_bias is not None}, normalization={self.normalization}, activation={self.activation}"
        )
