"""Computing and writing weight gradients: into ``.grad`` (accumulate) or into a data-parallel ``main_grad``.

These are the only places splitgrad computes or writes a linear's parameter gradients, for modules and ops
alike, so the accumulate-never-overwrite rule, Megatron's ``main_grad`` attributes (``overwrite_main_grad``,
``grad_added_to_main_grad``) and the checks before any write live here once. The immediate path returns
:func:`linear_wgrad` to autograd and the delayed path writes exactly that product, so delayed and immediate
are bitwise identical; the fused path adds it into ``main_grad`` with one ``addmm_`` (no weight-sized
temporary) in both its immediate and delayed forms, which are bitwise identical to each other. Fused against
unfused is the same sum through another BLAS kernel: equal within rounding, and how it rounds depends on
the kernel the CPU dispatches to.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import torch
from torch import nn

__all__ = [
    "accumulate_grad",
    "bias_wgrad",
    "check_targets",
    "check_writable",
    "linear_wgrad",
    "require_main_grad",
    "write_checked_linear_wgrad",
    "write_linear_wgrad",
]


def linear_wgrad(dy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``dW = dy.T @ x`` of ``y = x @ W.T``: ``dy: (tokens, out)``, ``x: (tokens, in)`` -> ``(out, in)``."""
    return dy.t().mm(x)


def bias_wgrad(dy: torch.Tensor) -> torch.Tensor:
    """Bias gradient ``(out_features,)`` of ``dy: (tokens, out_features)``."""
    return dy.sum(0)


def accumulate_grad(param: nn.Parameter, grad: torch.Tensor) -> None:
    """``param.grad += grad`` (the first write assigns), exactly what autograd's AccumulateGrad computes.

    ``grad`` is cast to the parameter's dtype first (under autocast it is computed in the autocast dtype),
    as autograd casts a returned gradient to its input's dtype.
    """
    if grad.dtype != param.dtype:
        grad = grad.to(param.dtype)
    if param.grad is None:
        param.grad = grad
    else:
        param.grad.add_(grad)


def check_writable(param: torch.Tensor, owner: str, name: str) -> None:
    """Refuse a parameter whose gradient splitgrad cannot write correctly (a sharded ``DTensor``).

    FSDP2 (``fully_shard``) swaps sharded DTensor parameters back in after backward, so a deferred task would
    add an unreduced full gradient to a shard: refused, naming the supported path
    (:func:`splitgrad.parallel.defer_fsdp_reduction`, which puts the unsharded parameter back for the write).
    """
    # torch.distributed.tensor is imported by whoever makes DTensors; if it is not loaded, none exist.
    if "torch.distributed.tensor" in sys.modules:
        from torch.distributed.tensor import DTensor

        if isinstance(param, DTensor):
            raise RuntimeError(
                f"{owner}: `{name}` is a DTensor (sharded, e.g. by FSDP2's fully_shard) when its deferred weight "
                "gradient is written; the full, unreduced gradient cannot go there. Under FSDP2 call "
                "splitgrad.parallel.defer_fsdp_reduction(model) after fully_shard (it reduce-scatters at the "
                "group's last W; see docs/fsdp_compile.md), or use immediate mode, or "
                "splitgrad.parallel.DistributedDataParallel (docs/parallel.md)"
            )


def require_main_grad(
    param: nn.Parameter, owner: str, name: str, flag: str = "fuse_wgrad_accumulation"
) -> torch.Tensor:
    """Return ``param.main_grad`` after checking it exists and matches the parameter's shape.

    Args:
        param: the parameter; owner, name: for the message (the layer, the parameter's attribute name).
        flag: the layer's name for the switch (``fuse_wgrad_accumulation`` or ops' ``accumulate_into_main_grad``).
    """
    main_grad = getattr(param, "main_grad", None)
    if main_grad is None:
        raise RuntimeError(
            f"{owner}: {flag}=True needs `{name}.main_grad` (a buffer of shape {tuple(param.shape)}, normally "
            "set by a data-parallel wrapper such as splitgrad.parallel.DistributedDataParallel), but the "
            "parameter has none"
        )
    if main_grad.shape != param.shape:
        raise RuntimeError(
            f"{owner}: `{name}.main_grad` has shape {tuple(main_grad.shape)}, expected {tuple(param.shape)}"
        )
    return main_grad


def check_targets(
    targets: Sequence[tuple[nn.Parameter | None, bool, str, bool]],
    *,
    owner: str,
    flag: str = "fuse_wgrad_accumulation",
) -> None:
    """Check every ``(param, wanted, name, into_main_grad)`` before any gradient is written.

    A task that writes several gradients calls this first, so a failure leaves nothing half written and the
    task can be retried without counting a gradient twice.
    """
    for param, wanted, name, into_main_grad in targets:
        if param is None or not wanted:
            continue
        check_writable(param, owner, name)
        if into_main_grad:
            require_main_grad(param, owner, name, flag)


def write_linear_wgrad(
    weight: nn.Parameter,
    bias: nn.Parameter | None,
    dy: torch.Tensor,
    x: torch.Tensor,
    *,
    want_w: bool,
    want_b: bool,
    fused: bool,
    owner: str,
    name: str,
    flag: str = "fuse_wgrad_accumulation",
) -> None:
    """Accumulate the gradients of ``y = x @ weight.T + bias`` into ``.grad`` / ``weight.main_grad``.

    With ``fused`` the weight gradient is computed straight into ``weight.main_grad`` with one addmm (no
    weight-sized temporary); ``weight.overwrite_main_grad = True`` overwrites instead of accumulating, and
    ``weight.grad_added_to_main_grad``, when the attribute exists, is set True afterwards (Megatron's DDP
    reads it to skip its own add). The bias gradient always goes to ``bias.grad``.

    Args:
        weight: ``(out, in)``.
        bias: ``(out,)`` or None.
        dy: ``(tokens, out)`` output gradient; x: ``(tokens, in)`` saved input.
        want_w, want_b: which gradients are owed (frozen parameters get none).
        fused: write the weight gradient into ``main_grad``.
        owner, name, flag: for error messages (the layer, the weight's attribute name, the fused switch's name).
    """
    targets = [(weight, want_w, name, fused), (bias, want_b, name.replace("weight", "bias"), False)]
    check_targets(targets, owner=owner, flag=flag)
    if want_w:
        write_checked_linear_wgrad(weight, dy, x, fused=fused)
    if want_b:
        accumulate_grad(bias, bias_wgrad(dy))


def write_checked_linear_wgrad(
    weight: nn.Parameter, dy: torch.Tensor, x: torch.Tensor, *, fused: bool
) -> None:
    """The weight half of :func:`write_linear_wgrad` once :func:`check_targets` passed: one ``addmm_`` into
    ``main_grad`` (``fused``) or the GEMM added into ``.grad``. ``dy: (tokens, out)``, ``x: (tokens, in)``."""
    if fused:
        _add_into_main_grad(weight, dy, x, weight.main_grad)
    else:
        accumulate_grad(weight, linear_wgrad(dy, x))


def _add_into_main_grad(
    weight: nn.Parameter, dy: torch.Tensor, x: torch.Tensor, main_grad: torch.Tensor
) -> None:
    beta = 0.0 if getattr(weight, "overwrite_main_grad", False) else 1.0
    if dy.dtype != main_grad.dtype:
        # Mixed precision (bf16 activations, fp32 buffer): upcasting the operands costs activation-sized
        # temporaries, never a weight-sized one, and keeps the whole reduction in the buffer's precision.
        dy = dy.to(main_grad.dtype)
        x = x.to(main_grad.dtype)
    main_grad.addmm_(dy.t(), x, beta=beta)
    if hasattr(weight, "grad_added_to_main_grad"):
        weight.grad_added_to_main_grad = True
