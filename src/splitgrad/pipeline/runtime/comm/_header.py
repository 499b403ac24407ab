"""The shape header a pipeline message channel opens with: ``[ndim, dtype code, *shape]`` as int64.

A receiver must allocate a buffer of the sender's shape before it can post a receive. On a runtime's first
step (and after :meth:`~splitgrad.pipeline.PipelineRuntime.reset_shapes`) the first message of each channel is
preceded by this header; later steps reuse the shapes learned then, so no header is on their critical path.
"""

from __future__ import annotations

import torch

__all__ = ["DTYPES", "HEADER_LEN", "MAX_NDIM", "decode_header", "encode_header"]

#: dtypes a header can name (its code is the index); append only, never reorder.
DTYPES: tuple[torch.dtype, ...] = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
)
MAX_NDIM = 8
HEADER_LEN = 2 + MAX_NDIM


def encode_header(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The header announcing ``tensor``'s shape and dtype: int64 ``(HEADER_LEN,)`` on ``device``.

    Raises:
        ValueError: more than ``MAX_NDIM`` dimensions or a dtype outside ``DTYPES``.
    """
    if tensor.dim() > MAX_NDIM or tensor.dtype not in DTYPES:
        raise ValueError(
            f"pipeline messages support up to {MAX_NDIM} dims and dtypes {DTYPES}; got "
            f"shape {tuple(tensor.shape)} dtype {tensor.dtype}"
        )
    values = [tensor.dim(), DTYPES.index(tensor.dtype), *tensor.shape]
    values += [0] * (HEADER_LEN - len(values))
    return torch.tensor(values, dtype=torch.int64, device=device)


def decode_header(header: torch.Tensor) -> tuple[tuple[int, ...], torch.dtype]:
    """``(shape, dtype)`` from a received header (int64 ``(HEADER_LEN,)``).

    Raises:
        RuntimeError: a header no :func:`encode_header` wrote.
    """
    values = header.tolist()
    ndim, code = int(values[0]), int(values[1])
    if not (0 <= ndim <= MAX_NDIM and 0 <= code < len(DTYPES)):
        raise RuntimeError(f"corrupt pipeline message header {values} (peers running different versions?)")
    return tuple(int(v) for v in values[2 : 2 + ndim]), DTYPES[code]
