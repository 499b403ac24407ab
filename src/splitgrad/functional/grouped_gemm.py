"""The grouped GEMM of an expert layer: torch's ``grouped_mm`` where it applies, a loop of ``mm`` elsewhere.

Rows of ``x: (tokens, in)`` are grouped by ``splits`` (consecutive row blocks, one per group); group ``g``
multiplies its rows by its own weight. The weight is either one 3-D tensor ``(groups, out, in)`` (TE's
``single_grouped_weight``, HuggingFace's experts; ``(groups, in, out)`` with ``transposed=True``, gpt-oss) or a
sequence of 2-D ``(out, in)`` tensors (``weight0 .. weight{n-1}``).

**Which path runs.** ``path="auto"`` picks :func:`torch.nn.functional.grouped_mm` (``torch._grouped_mm`` on
older torch) when :func:`grouped_mm_refusal` finds nothing against it: a 3-D weight, every operand in float32,
bfloat16 or float16 (one dtype), on the CPU or a CUDA device of compute capability 8.0 or more, no zero
(broadcast) strides, every non-unit stride and every data pointer a multiple of 16 bytes. Anything else
(float64, odd feature sizes, the per-group-weights layout, ``meta``) runs the loop. Stacking separate weights
into one tensor to reach ``grouped_mm`` would copy every weight on every call, so that layout always loops.

**Same results.** Both paths compute ``x_g @ W_g.T`` per group. On the CPU, torch 2.13's ``grouped_mm`` *is*
a loop of ``at::mm_out`` over the same slices (``GroupedMMUtils.h``), so the two agree bit for bit there; on
CUDA it is another kernel (CUTLASS), equal within floating-point rounding. The tests hold both paths to
float-tight tolerances on the same inputs and never rely on the CPU coincidence. With a bias the loop uses
``addmm`` and the grouped path adds the bias afterwards: also equal within rounding only.

**Accumulating into ``main_grad``.** ``grouped_mm`` has no ``out=``: its weight gradient is always a new
``(groups, out, in)`` tensor. That is fine when it *is* the gradient (``.grad``), but adding it into
``main_grad`` would allocate a weight-sized temporary, which fused accumulation promises never to do. So
:func:`grouped_wgrad_into_` always runs one ``addmm_`` per group straight into ``main_grad[g]``.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
import torch.nn.functional as F

__all__ = [
    "PATHS",
    "GroupedWeight",
    "choose_path",
    "group_offsets",
    "grouped_bias_grad",
    "grouped_dgrad",
    "grouped_forward",
    "grouped_mm_refusal",
    "grouped_wgrad",
    "grouped_wgrad_into_",
]

#: One ``(groups, out, in)`` tensor (``(groups, in, out)`` when transposed), or one ``(out, in)`` per group.
GroupedWeight = torch.Tensor | Sequence[torch.Tensor]
#: ``"auto"`` chooses; ``"loop"`` and ``"grouped_mm"`` force one (the latter raises where it cannot run).
PATHS = ("auto", "loop", "grouped_mm")
_GROUPED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _grouped_mm_op():
    return getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def grouped_mm_refusal(*operands: torch.Tensor) -> str | None:
    """Why torch's ``grouped_mm`` cannot take these operands (as they would be passed); None when it can.

    Args:
        operands: the tensors handed to ``grouped_mm`` (views included: their strides are what counts).

    Returns:
        A short reason naming the offending dtype, device, shape or stride, or None.
    """
    if _grouped_mm_op() is None:
        return f"torch {torch.__version__} has no grouped_mm"
    dtypes = {t.dtype for t in operands}
    if len(dtypes) != 1 or next(iter(dtypes)) not in _GROUPED_DTYPES:
        return f"dtypes {sorted(map(str, dtypes))}: grouped_mm takes one of float32, bfloat16, float16"
    device = operands[0].device
    if device.type == "cuda":
        if torch.cuda.get_device_capability(device) < (8, 0):
            return f"{device} has compute capability < 8.0"
    elif device.type != "cpu":
        return f"device {device}: only cpu and cuda"
    for t in operands:
        size = t.element_size()
        for dim, stride in zip(t.shape, t.stride()):
            if dim > 1 and stride == 0:
                return f"a broadcast operand (stride 0) of shape {tuple(t.shape)}"
            if dim > 1 and stride != 1 and (stride * size) % 16:
                return f"stride {stride} of shape {tuple(t.shape)} is not a multiple of 16 bytes"
        if t.data_ptr() % 16:
            return f"a data pointer of shape {tuple(t.shape)} is not 16-byte aligned"
    return None


def choose_path(path: str, *operands: torch.Tensor, separate: bool = False) -> str:
    """``"loop"`` or ``"grouped_mm"`` for ``path`` (one of :data:`PATHS`) and the operands as passed.

    Args:
        path: one of :data:`PATHS`.
        operands: the tensors ``grouped_mm`` would get.
        separate: the weights are separate tensors (the loop is the only path).

    Raises:
        ValueError: ``path`` is unknown, or ``"grouped_mm"`` is forced where it cannot run (with the reason).
    """
    if path not in PATHS:
        raise ValueError(f"grouped GEMM path must be one of {PATHS}, got {path=}")
    if path == "loop":
        return "loop"
    why = "the weights are separate tensors" if separate else grouped_mm_refusal(*operands)
    if why is None:
        return "grouped_mm"
    if path == "grouped_mm":
        raise ValueError(f"grouped GEMM: path='grouped_mm' cannot run here: {why}")
    return "loop"


def group_offsets(splits: Sequence[int], device: torch.device) -> torch.Tensor:
    """``grouped_mm``'s ``offs``: the cumulative end row of each group, int32, on ``device``."""
    ends = list(itertools.accumulate(splits))
    if ends and ends[-1] > torch.iinfo(torch.int32).max:
        raise ValueError(f"grouped GEMM: {ends[-1]} rows exceed grouped_mm's int32 offsets")
    return torch.tensor(ends, dtype=torch.int32, device=device)


def _rows(t: torch.Tensor, splits: Sequence[int]) -> tuple[torch.Tensor, ...]:
    return torch.split(t, list(splits))


def _per_group(weight: GroupedWeight) -> Sequence[torch.Tensor]:
    return weight.unbind(0) if isinstance(weight, torch.Tensor) else weight


def _bias_rows(bias: torch.Tensor | Sequence[torch.Tensor], splits: Sequence[int], rows: int) -> torch.Tensor:
    """Each group's bias repeated over its rows: ``(rows, out)``."""
    stacked = bias if isinstance(bias, torch.Tensor) else torch.stack(list(bias))
    counts = torch.tensor(list(splits), device=stacked.device)
    return torch.repeat_interleave(stacked, counts, dim=0, output_size=rows)


def grouped_forward(
    x: torch.Tensor,
    weight: GroupedWeight,
    splits: Sequence[int],
    *,
    bias: torch.Tensor | Sequence[torch.Tensor] | None = None,
    transposed: bool = False,
    path: str = "auto",
    offs: torch.Tensor | None = None,
) -> torch.Tensor:
    """``y_g = x_g @ W_g.T (+ b_g)`` for each row group.

    Args:
        x: ``(tokens, in)``, rows grouped by ``splits`` (``sum(splits) == tokens``, checked by the caller).
        weight: ``(groups, out, in)`` (``(groups, in, out)`` with ``transposed``) or ``groups`` tensors ``(out, in)``.
        splits: rows per group.
        bias: ``(groups, out)``, ``groups`` tensors ``(out,)``, or None.
        transposed: the 3-D weight is stored ``(groups, in, out)`` (``y_g = x_g @ W_g``).
        path: see :data:`PATHS`.
        offs: :func:`group_offsets` of ``splits`` when the caller has them (computed here otherwise).

    Returns:
        ``(tokens, out)``.
    """
    separate = not isinstance(weight, torch.Tensor)
    wt = weight if separate or transposed else weight.transpose(-2, -1)
    if choose_path(path, *([] if separate else [x, wt]), separate=separate) == "grouped_mm":
        y = _grouped_mm_op()(x, wt, offs=group_offsets(splits, x.device) if offs is None else offs)
        if bias is not None:
            y.add_(_bias_rows(bias, splits, x.shape[0]))
        return y
    weights = _per_group(weight)
    biases = _per_group(bias) if bias is not None else (None,) * len(weights)
    out = weights[0].shape[0] if not transposed else weights[0].shape[1]
    y = x.new_empty(x.shape[0], out)
    for xg, yg, w, b in zip(_rows(x, splits), _rows(y, splits), weights, biases):
        if xg.shape[0] == 0:
            continue
        wg = w if transposed else w.t()
        # The ops F.linear dispatches to for 2-D inputs, written in place: bitwise equal to it.
        if b is None:
            torch.mm(xg, wg, out=yg)
        else:
            torch.addmm(b, xg, wg, out=yg)
    return y


def grouped_dgrad(
    dy: torch.Tensor,
    weight: GroupedWeight,
    splits: Sequence[int],
    *,
    transposed: bool = False,
    path: str = "auto",
    offs: torch.Tensor | None = None,
) -> torch.Tensor:
    """Input gradient ``dx_g = dy_g @ W_g`` (``dy_g @ W_g.T`` when transposed).

    Args:
        dy: ``(tokens, out)`` output gradient (contiguous: ``grouped_mm`` refuses broadcast gradients).
        weight, splits, transposed, path, offs: as :func:`grouped_forward`.

    Returns:
        ``(tokens, in)``.
    """
    separate = not isinstance(weight, torch.Tensor)
    wt = weight.transpose(-2, -1) if not separate and transposed else weight
    if choose_path(path, *([] if separate else [dy, wt]), separate=separate) == "grouped_mm":
        return _grouped_mm_op()(dy, wt, offs=group_offsets(splits, dy.device) if offs is None else offs)
    weights = _per_group(weight)
    inp = weights[0].shape[1] if not transposed else weights[0].shape[0]
    dx = dy.new_empty(dy.shape[0], inp)
    for dyg, dxg, w in zip(_rows(dy, splits), _rows(dx, splits), weights):
        if dyg.shape[0] != 0:
            torch.mm(dyg, w.t() if transposed else w, out=dxg)
    return dx


def grouped_wgrad(
    dy: torch.Tensor,
    x: torch.Tensor,
    splits: Sequence[int],
    *,
    stacked: bool = True,
    transposed: bool = False,
    path: str = "auto",
    offs: torch.Tensor | None = None,
) -> torch.Tensor | list[torch.Tensor]:
    """Weight gradient ``dW_g = dy_g.T @ x_g`` (``x_g.T @ dy_g`` when transposed); zeros for empty groups.

    Args:
        dy: ``(tokens, out)``; x: ``(tokens, in)``; splits: rows per group.
        stacked: return one ``(groups, out, in)`` tensor (else a list of ``(out, in)``; always the loop).
        transposed: the gradient of a ``(groups, in, out)`` weight.
        path, offs: as :func:`grouped_forward` (only for ``stacked``).

    Returns:
        ``(groups, out, in)`` (``(groups, in, out)`` when transposed) or one ``(out, in)`` per group.
    """
    a, b = (x, dy) if transposed else (dy, x)
    if not stacked:
        choose_path(path, separate=True)  # raises if grouped_mm is forced
        return [ag.t().mm(bg) for ag, bg in zip(_rows(a, splits), _rows(b, splits))]
    if choose_path(path, a.t(), b) == "grouped_mm":
        return _grouped_mm_op()(a.t(), b, offs=group_offsets(splits, dy.device) if offs is None else offs)
    dw = a.new_empty(len(splits), a.shape[1], b.shape[1])
    for g, (ag, bg) in enumerate(zip(_rows(a, splits), _rows(b, splits))):
        torch.mm(ag.t(), bg, out=dw[g])  # the op linear_wgrad runs, written in place
    return dw


def grouped_bias_grad(
    dy: torch.Tensor, splits: Sequence[int], *, stacked: bool = True
) -> torch.Tensor | list[torch.Tensor]:
    """Each group's bias gradient ``dy_g.sum(0)``: ``(groups, out)`` or a list of ``(out,)``."""
    parts = _rows(dy, splits)
    if not stacked:
        return [p.sum(0) for p in parts]
    db = dy.new_empty(len(splits), dy.shape[1])
    for g, p in enumerate(parts):
        torch.sum(p, 0, out=db[g])
    return db


def grouped_wgrad_into_(
    main_grad: torch.Tensor,
    dy: torch.Tensor,
    x: torch.Tensor,
    splits: Sequence[int],
    *,
    transposed: bool = False,
    beta: float = 1.0,
) -> None:
    """``main_grad[g] = beta * main_grad[g] + dW_g`` with one ``addmm_`` per group, no weight-sized temporary.

    Args:
        main_grad: ``(groups, out, in)`` (``(groups, in, out)`` when transposed).
        dy: ``(tokens, out)``; x: ``(tokens, in)``; splits: rows per group.
        beta: 0.0 overwrites (``overwrite_main_grad``), 1.0 accumulates.
    """
    if dy.dtype != main_grad.dtype:
        # Mixed precision (bf16 activations, fp32 buffer): activation-sized upcasts, never a weight-sized one.
        dy, x = dy.to(main_grad.dtype), x.to(main_grad.dtype)
    a, b = (x, dy) if transposed else (dy, x)
    for g, (ag, bg) in enumerate(zip(_rows(a, splits), _rows(b, splits))):
        if ag.shape[0] == 0:
            if beta == 0.0:
                main_grad[g].zero_()
            continue
        main_grad[g].addmm_(ag.t(), bg, beta=beta)
