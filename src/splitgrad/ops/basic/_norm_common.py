"""What ``ops.LayerNorm`` and ``ops.RMSNorm`` share: argument checks, parameters, repr (not the arithmetic)."""

from __future__ import annotations

import torch
from torch import nn

from ..op import BasicOperation

__all__ = ["NormOperation", "check_normalized_input", "normalized_shape_tuple"]


def normalized_shape_tuple(
    owner: str, normalized_shape: int | tuple[int, ...] | list[int]
) -> tuple[int, ...]:
    """``normalized_shape`` as a tuple of positive ints, or ``ValueError`` naming ``owner``."""
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    if not shape or any(not isinstance(n, int) or n <= 0 for n in shape):
        raise ValueError(f"{owner} needs positive normalized_shape, got {normalized_shape=}")
    return shape


def check_normalized_input(op: BasicOperation, x: torch.Tensor, shape: tuple[int, ...]) -> None:
    """Raise ``ValueError`` naming ``op`` unless ``x`` ends with ``shape``."""
    if x.dim() < len(shape) or tuple(x.shape[-len(shape) :]) != shape:
        raise ValueError(
            f"{op._describe()}: input's trailing dimensions must be normalized_shape={shape}, got input shape "
            f"{tuple(x.shape)}"
        )


class NormOperation(BasicOperation):
    """A norm over the trailing ``normalized_shape`` dimensions with ``weight`` (ones) and, if any, ``bias`` (zeros).

    Subclasses set ``_label`` (how errors name them) and ``_has_bias``, and implement the arithmetic
    (``op_forward``/``op_backward``). Parameters are created in ``nn.LayerNorm``'s order and initial values.

    Args:
        normalized_shape: trailing dimensions to normalise.
        eps: added to the variance (LayerNorm) or the mean square (RMSNorm).
        dtype: parameter dtype (default: torch's default dtype).
        device: parameter device.
    """

    _label: str = "ops.NormOperation"
    """The op as error messages name it (``"ops.LayerNorm"``)."""
    _has_bias: bool = False
    """Whether the op learns an additive ``bias`` of shape ``normalized_shape``."""

    def __init__(
        self,
        normalized_shape: int | tuple[int, ...] | list[int],
        eps: float = 1e-5,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.normalized_shape = normalized_shape_tuple(self._label, normalized_shape)
        if eps < 0:
            raise ValueError(f"{self._label} needs eps >= 0, got {eps=}")
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(self.normalized_shape, dtype=dtype, device=device))
        if self._has_bias:
            self.bias = nn.Parameter(torch.zeros(self.normalized_shape, dtype=dtype, device=device))

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}"
