"""``ops.Linear``: the composite ``BasicLinear + Bias``, a drop-in ``nn.Linear`` (same parameters and state_dict)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ..core import WeightGradStore
from ..functional.init import linear_init_
from .basic._split_op import split_repr
from .basic.basic_linear import BasicLinear
from .basic.bias import Bias
from .fused import default_fusions
from .fuser import FusionRegistry
from .op import BasicOperation, FusibleOperation

__all__ = ["Linear"]


class Linear(FusibleOperation):
    """``y = x @ weight.T + bias`` made of :class:`BasicLinear` and :class:`Bias`.

    The parameters ``weight`` and ``bias`` are this module's (``nn.Linear``'s names, initialisation and
    state_dict keys); the two basic ops are internal and share them. With the default fusions the forward is
    one addmm. The split-backward API delegates to the inner ``BasicLinear``: only ``weight`` is deferred;
    the bias gradient is returned in the main backward (see :class:`Bias`).

    Args:
        in_features: size of the last input dimension.
        out_features: size of the last output dimension.
        bias: learn an additive bias.
        delay_wgrad_compute: defer the weight gradient to :meth:`backward_dw`.
        accumulate_into_main_grad: add the weight gradient into ``weight.main_grad``.
        dtype: parameter dtype (default: torch's default dtype).
        device: parameter device.

    Shapes: ``x: (..., in_features)`` -> ``(..., out_features)``.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        bias: bool = True,
        delay_wgrad_compute: bool = False,
        accumulate_into_main_grad: bool = False,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        linear = BasicLinear(
            in_features,
            out_features,
            delay_wgrad_compute=delay_wgrad_compute,
            accumulate_into_main_grad=accumulate_into_main_grad,
            dtype=dtype,
            device=device,
        )
        ops: list[BasicOperation] = [linear]
        self.in_features = in_features
        self.out_features = out_features
        self.weight = linear.weight
        if bias:
            bias_op = Bias(out_features, dtype=dtype, device=device)
            ops.append(bias_op)
            self.bias = bias_op.bias
        else:
            self.register_parameter("bias", None)
        # Kept out of the module tree on purpose: the parameters are registered here, once.
        self.__dict__["_ops"] = tuple(ops)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """``torch.nn.Linear``'s initialisation."""
        linear_init_(self.weight, self.bias)

    def _link(self) -> None:
        # load_state_dict(assign=True) or a dtype/device conversion may have replaced the Parameter objects.
        linear = self._ops[0]
        if linear._parameters["weight"] is not self.weight:
            linear._parameters["weight"] = self.weight
            linear.refresh_skip_backward_post_hook()
        if self.bias is not None and self._ops[1]._parameters["bias"] is not self.bias:
            self._ops[1]._parameters["bias"] = self.bias

    def basic_ops(self) -> list[BasicOperation]:
        self._link()
        return list(self._ops)

    def pre_forward(self) -> None:
        self._link()

    def standalone_fusions(self) -> FusionRegistry:
        # Called on its own, the pair BasicLinear + Bias fuses into one addmm, as inside a Sequential.
        return default_fusions()

    # -- the split-backward API of the inner BasicLinear ---------------------------------------------------
    @property
    def wgrad_store(self) -> WeightGradStore:
        return self._ops[0].wgrad_store

    @property
    def fuse_wgrad_accumulation(self) -> bool:
        return self._ops[0].fuse_wgrad_accumulation

    @property
    def accumulate_into_main_grad(self) -> bool:
        return self._ops[0].fuse_wgrad_accumulation

    def need_backward_dw(self) -> bool:
        """True when the weight gradient is deferred to :meth:`backward_dw`."""
        return self._ops[0].need_backward_dw()

    def backward_dw(self) -> None:
        """Run the oldest pending weight-gradient task, write ``weight``'s gradient, fire the hooks."""
        self._link()
        self._ops[0].backward_dw()

    def register_wgrad_accumulation_and_reduce_hooks(self, hook: Callable[[], None]) -> RemovableHandle:
        """Call ``hook()`` after every completed weight-gradient task (``.grad`` and ``main_grad`` paths)."""
        return self._ops[0].register_wgrad_accumulation_and_reduce_hooks(hook)

    def get_backward_dw_params(self) -> list[nn.Parameter]:
        """The parameters :meth:`backward_dw` writes: ``[weight]`` when trainable."""
        self._link()
        return self._ops[0].get_backward_dw_params()

    def set_delay_wgrad_compute(self, enabled: bool) -> None:
        """Switch deferral on/off; pending tasks stay pending."""
        self._link()
        self._ops[0].set_delay_wgrad_compute(enabled)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"{split_repr(self)}"
        )
