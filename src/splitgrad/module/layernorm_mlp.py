"""``splitgrad.LayerNormMLP``: ``fc2(act(fc1(norm(x))))`` whose backward can defer both fc wgrads as one task."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..core import SplitModule, split_backward
from ..distributed.tp_config import shard_size, tensor_parallel_config
from ..functional.activations import activation_backward, activation_forward, check_activation, is_gated
from ..functional.init import linear_init_
from ..functional.norm import check_normalization, init_norm_
from ..functional.split_sizes import check_positive_sizes
from ..functional.wgrad import bias_wgrad, check_targets, linear_wgrad, write_linear_wgrad
from ._fused_norm import fused_norm_backward, fused_norm_forward
from ._layer_setup import (
    init_norm_settings,
    init_te_settings,
    register_norm_parameters,
    register_optional_parameter,
)
from ._linear_wgrad import route_wgrad_at_forward
from ._te_keywords import refuse_unsupported_te_keywords, rng_tracker_fork
from ._tp_mlp import _TPMLPFunction
from ._tp_norm import module_norm_autograd
from ._tp_params import init_tp_linear_, mark_sequence_parallel, mark_tp_params

__all__ = ["LayerNormMLP"]


class _LayerNormMLPFunction(torch.autograd.Function):
    """Autograd Function of :class:`LayerNormMLP`.

    Shapes: ``x: (..., hidden)``, ``fc1_weight: (F1, hidden)`` with ``F1 = ffn`` or ``2 * ffn`` (gated),
    ``fc2_weight: (hidden, ffn)`` -> ``y: (..., hidden)``. Both fcs' weight gradients form ONE task per
    backward (whatever is frozen), so one ``backward_dw()`` completes one backward and hooks fire once.
    """

    @staticmethod
    def forward(ctx, x, ln_w, ln_b, fc1_w, fc1_b, fc2_w, fc2_b, owner: LayerNormMLP):  # type: ignore[override]
        params = (owner.fc1_weight, owner.fc1_bias, owner.fc2_weight, owner.fc2_bias)
        route_wgrad_at_forward(ctx, owner, params, has_bias=fc1_b is not None)
        ctx.activation = owner.activation
        x2, gamma, ln_out, stats = fused_norm_forward(ctx, owner, x, ln_w, ln_b)
        h = F.linear(ln_out, fc1_w, fc1_b)
        act_out, extra = activation_forward(h, owner.activation)
        y = F.linear(act_out, fc2_w, fc2_b)
        ctx.save_for_backward(x2, ln_out, gamma, ln_b, fc1_w, fc2_w, h, act_out, extra, *stats)
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
            dx, dg, dbeta = fused_norm_backward(ctx, dh.mm(fc1_w), x2, stats, gamma, ln_b, want_norm)

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
        tp_group, tp_size, sequence_parallel, init_method, sp_wgrad_input: as :class:`~splitgrad.Linear`, with
            fc1 column-parallel and fc2 row-parallel (implied, as TE): ``fc1_weight (F1/tp, hidden)`` holds
            this rank's rows of both gated halves, ``fc2_weight (hidden, ffn/tp)``; the norm runs on the
            local activation (``sequence_parallel = True`` on its parameters and on ``fc2_bias`` under
            sequence parallelism). ``init_method`` initialises each local fc weight.
        return_bias: return ``(output, fc2_bias)`` without adding fc2's bias (its gradient then flows through
            autograd).
        delay_wgrad_compute: park the fcs' weight gradients for :meth:`backward_dw`.
        fuse_wgrad_accumulation: add the fcs' weight gradients into their ``main_grad``.
        params_dtype: parameter dtype (default: torch's default dtype).
        device: parameter device.
        set_parallel_mode: TE's switch for fc1 column / fc2 row. None or True: split whenever ``tp_group`` has
            more than one rank; False with such a group (TE: sharded weights, no communication) is a
            ``ValueError``.
        output_layer_init_method: ``output_layer_init_method(weight)`` initialises the local fc2 weight (then
            ``init_method`` initialises only fc1, as TE); None: fc2 as without it.
        get_rng_state_tracker, name: as :class:`~splitgrad.Linear`.
        activation_params, return_layernorm_output, return_layernorm_output_gathered, checkpoint,
            symmetric_ar_type, ub_overlap_ag, ub_overlap_rs, ub_overlap_rs_dgrad, ub_bulk_dgrad, ub_bulk_wgrad:
            accepted at TE's default only (``ValueError`` otherwise, saying what to use).
        seq_length, micro_batch_size: accepted, no effect (TE warms up JIT kernels with them). Every TE
            keyword: docs/modules.md.

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
        tp_group: torch.distributed.ProcessGroup | None = None,
        tp_size: int | None = None,
        sequence_parallel: bool = False,
        return_bias: bool = False,
        init_method: Callable[[torch.Tensor], object] | None = None,
        delay_wgrad_compute: bool = False,
        fuse_wgrad_accumulation: bool = False,
        params_dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        sp_wgrad_input: str = "keep",
        set_parallel_mode: bool | None = None,
        output_layer_init_method: Callable[[torch.Tensor], object] | None = None,
        get_rng_state_tracker: Callable[[], object] | None = None,
        name: str | None = None,
        activation_params: dict | None = None,
        return_layernorm_output: bool = False,
        return_layernorm_output_gathered: bool = False,
        seq_length: int | None = None,
        micro_batch_size: int | None = None,
        checkpoint: bool = False,
        symmetric_ar_type: str | None = None,
        ub_overlap_ag: bool = False,
        ub_overlap_rs: bool = False,
        ub_overlap_rs_dgrad: bool = False,
        ub_bulk_dgrad: bool = False,
        ub_bulk_wgrad: bool = False,
    ) -> None:
        super().__init__()
        check_positive_sizes("LayerNormMLP", hidden_size=hidden_size, ffn_hidden_size=ffn_hidden_size)
        owner = f"LayerNormMLP({hidden_size}, {ffn_hidden_size})"
        refuse_unsupported_te_keywords("LayerNormMLP", owner, locals())
        self._output_layer_init_method = output_layer_init_method
        check_normalization("LayerNormMLP", normalization)
        check_activation("LayerNormMLP", activation)
        init_norm_settings(
            self,
            "LayerNormMLP",
            normalization=normalization,
            eps=eps,
            zero_centered_gamma=zero_centered_gamma,
        )
        self.hidden_size = hidden_size
        self.ffn_hidden_size = ffn_hidden_size
        self.activation = activation
        init_te_settings(
            self, "LayerNormMLP", name=name, return_bias=return_bias, sp_wgrad_input=sp_wgrad_input,
            init_method=init_method, rng=(get_rng_state_tracker, None),
        )  # fmt: skip
        # fc1 column / fc2 row is implied; the config records "column" for the module's input side.
        self.tp = tensor_parallel_config(
            tp_group=tp_group, tp_size=tp_size, parallel_mode="column" if tp_group is not None else None,
            sequence_parallel=sequence_parallel, owner=owner,
        )  # fmt: skip
        if set_parallel_mode is False and self.tp.size > 1:
            raise ValueError(
                f"{owner}: set_parallel_mode=False with a {self.tp.size}-rank tp_group (TE's sharded weights "
                "without communication) is not supported; pass set_parallel_mode=True or leave it None"
            )
        ffn_local = shard_size(ffn_hidden_size, self.tp, owner=owner, name="ffn_hidden_size")
        factory = {"dtype": params_dtype, "device": device}
        fc1_out = 2 * ffn_local if is_gated(activation) else ffn_local
        register_norm_parameters(self, hidden_size, factory)
        self.fc1_weight = nn.Parameter(torch.empty(fc1_out, hidden_size, **factory))
        self.fc2_weight = nn.Parameter(torch.empty(hidden_size, ffn_local, **factory))
        register_optional_parameter(self, "fc1_bias", bias, (fc1_out,), factory)
        register_optional_parameter(self, "fc2_bias", bias, (hidden_size,), factory)
        self.reset_parameters()
        mark_tp_params(self.tp, self.fc1_weight, self.fc1_bias, "column")
        mark_tp_params(self.tp, self.fc2_weight, self.fc2_bias, "row")
        mark_sequence_parallel(self.tp, self.layer_norm_weight, self.layer_norm_bias)
        self.init_split(
            delay_wgrad_compute=delay_wgrad_compute, fuse_wgrad_accumulation=fuse_wgrad_accumulation
        )

    def reset_parameters(self) -> None:
        """Identity norm; each fc initialised like a ``torch.nn.Linear`` of the same shape."""
        init_norm_(self.layer_norm_weight, self.layer_norm_bias, self.zero_centered_gamma)
        fc2_init = self._output_layer_init_method
        with rng_tracker_fork(*self._rng):
            if self._init_method is None and fc2_init is None and not self.tp.splits:
                linear_init_(self.fc1_weight, self.fc1_bias)
                linear_init_(self.fc2_weight, self.fc2_bias)
                return
            fc2_mode = "row" if self.tp.splits else None
            if fc2_init is None:
                fc2_init = self._init_method  # init_method covers both fcs unless fc2 has its own (as before)
            init_tp_linear_("column", self.fc1_weight, self.fc1_bias, self.hidden_size, self._init_method)
            init_tp_linear_(fc2_mode, self.fc2_weight, self.fc2_bias, self.ffn_hidden_size, fc2_init)

    def forward(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]:
        """``x: (..., hidden_size)`` -> ``(..., hidden_size)`` (``(s/tp, b, hidden)`` in and out under
        sequence parallelism); ``(output, fc2_bias)`` with ``return_bias=True``."""
        self._check_last_dim(x, self.hidden_size, "hidden_size")
        fc2_bias = None if self.return_bias else self.fc2_bias
        if self.tp.splits:
            ln_out = module_norm_autograd(self, x)
            y = self.apply_function(
                _TPMLPFunction, ln_out, self.fc1_weight, self.fc1_bias, self.fc2_weight, fc2_bias, self
            )
        else:
            y = self.apply_function(
                _LayerNormMLPFunction, x, self.layer_norm_weight, self.layer_norm_bias,
                self.fc1_weight, self.fc1_bias, self.fc2_weight, fc2_bias, self,
            )  # fmt: skip
        return (y, self.fc2_bias) if self.return_bias else y

    def wgrad_parameters(self) -> list[nn.Parameter]:
        fc2_bias = None if self.return_bias else self.fc2_bias  # with return_bias autograd accumulates it
        params = [self.fc1_weight, self.fc1_bias, self.fc2_weight, fc2_bias]
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
        text = f"name={self.name!r}, " if self.name is not None else ""
        text += (
            f"hidden_size={self.hidden_size}, ffn_hidden_size={self.ffn_hidden_size}, "
            f"bias={self.fc1_bias is not None}, normalization={self.normalization}, activation={self.activation}"
        )
        if self.tp.splits:
            text += f", tp_size={self.tp.size}, sequence_parallel={self.tp.sequence_parallel}"
        return text
