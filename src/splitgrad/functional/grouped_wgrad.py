"""Weight gradients of one grouped linear, in either parameter layout: computed now or written later.

:class:`GroupedParams` names the parameters of one grouped linear: one ``(groups, out, in)`` weight (TE's
``single_grouped_weight``, HuggingFace's experts) or ``groups`` weights ``(out, in)``, and likewise for the
bias. :func:`grouped_gradients` computes what autograd gets back (immediate mode); :func:`write_grouped_wgrad`
accumulates the very same tensors into ``.grad`` (deferred mode), so the two are bitwise equal, or adds them
into ``main_grad`` with one ``addmm_`` per group (fused: no weight-sized temporary, see
:mod:`~splitgrad.functional.grouped_gemm`). Bias gradients always go to ``.grad``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from .grouped_gemm import GroupedWeight, grouped_bias_grad, grouped_wgrad, grouped_wgrad_into_
from .wgrad import (
    accumulate_grad,
    bias_wgrad,
    check_targets,
    linear_wgrad,
    write_checked_linear_wgrad,
)

__all__ = ["GroupedParams", "grouped_gradients", "grouped_targets", "write_grouped_wgrad"]


@dataclass(frozen=True, slots=True)
class GroupedParams:
    """The parameters of one grouped linear, in the order of its gradient slots (weights, then biases)."""

    weight: GroupedWeight
    """``(groups, out, in)`` (``(groups, in, out)`` when ``transposed``) or one ``(out, in)`` per group."""
    bias: torch.Tensor | Sequence[torch.Tensor] | None = None
    """``(groups, out)``, one ``(out,)`` per group, or None."""
    transposed: bool = False
    """The 3-D weight is stored ``(groups, in, out)`` (gpt-oss)."""
    weight_name: str = "weight"
    """How messages name the weight (``weight`` or, per group, ``weight0`` ..)."""
    bias_name: str = "bias"
    """How messages name the bias."""

    @property
    def weights(self) -> list[nn.Parameter]:
        """The weight parameter(s): one, or one per group."""
        return [self.weight] if isinstance(self.weight, torch.Tensor) else list(self.weight)

    @property
    def biases(self) -> list[nn.Parameter]:
        """The bias parameter(s): none, one, or one per group."""
        if self.bias is None:
            return []
        return [self.bias] if isinstance(self.bias, torch.Tensor) else list(self.bias)

    @property
    def tensors(self) -> list[nn.Parameter]:
        """Weights then biases: the gradient slots, in order."""
        return self.weights + self.biases

    def split_mask(self, mask: Sequence[bool]) -> tuple[tuple[bool, ...], tuple[bool, ...]]:
        """``mask`` over :attr:`tensors` as ``(weights' mask, biases' mask)``."""
        n = len(self.weights)
        if len(mask) != n + len(self.biases):
            raise ValueError(
                f"grouped wgrad: mask of {len(mask)} entries for {n + len(self.biases)} parameters"
            )
        return tuple(mask[:n]), tuple(mask[n:])

    def names(self) -> tuple[list[str], list[str]]:
        """Names of :attr:`weights` and :attr:`biases` for messages."""
        w, b = self.weights, self.biases

        def label(base: str, items: list, single: bool) -> list[str]:
            return [base] if single else [f"{base}{g}" for g in range(len(items))]

        return (
            label(self.weight_name, w, isinstance(self.weight, torch.Tensor)),
            label(self.bias_name, b, isinstance(self.bias, torch.Tensor)),
        )


def grouped_gradients(
    params: GroupedParams,
    dy: torch.Tensor,
    x: torch.Tensor,
    splits: Sequence[int],
    mask: Sequence[bool],
    offs: torch.Tensor | None = None,
) -> list[torch.Tensor | None]:
    """The masked gradients of :attr:`GroupedParams.tensors`, computed now (None where the mask is False).

    Args:
        params: the layer's parameters.
        dy: ``(tokens, out)`` output gradient; x: ``(tokens, in)`` input; splits: rows per group.
        mask: one entry per parameter of ``params.tensors``.
        offs: ``grouped_mm``'s offsets of ``splits``, when the caller has them.
    """
    mask_w, mask_b = params.split_mask(mask)
    out: list[torch.Tensor | None] = []
    if isinstance(params.weight, torch.Tensor):
        wgrad = grouped_wgrad(dy, x, splits, transposed=params.transposed, offs=offs) if mask_w[0] else None
        out.append(wgrad)
    else:
        pairs = zip(torch.split(dy, list(splits)), torch.split(x, list(splits)))
        out += [linear_wgrad(dyg, xg) if want else None for want, (dyg, xg) in zip(mask_w, pairs)]
    if isinstance(params.bias, torch.Tensor):
        out.append(grouped_bias_grad(dy, splits) if mask_b[0] else None)
    elif params.bias is not None:
        out += [bias_wgrad(dyg) if want else None for want, dyg in zip(mask_b, torch.split(dy, list(splits)))]
    return out


def grouped_targets(
    params: GroupedParams, mask: Sequence[bool], *, fused: bool
) -> list[tuple[nn.Parameter, bool, str, bool]]:
    """``(param, wanted, name, into_main_grad)`` per parameter, for
    :func:`~splitgrad.functional.wgrad.check_targets` (a layer writing several grouped linears checks them all
    before writing any)."""
    mask_w, mask_b = params.split_mask(mask)
    w_names, b_names = params.names()
    targets = [(w, want, n, fused) for w, want, n in zip(params.weights, mask_w, w_names)]
    return targets + [(b, want, n, False) for b, want, n in zip(params.biases, mask_b, b_names)]


def write_grouped_wgrad(
    params: GroupedParams,
    dy: torch.Tensor,
    x: torch.Tensor,
    splits: Sequence[int],
    mask: Sequence[bool],
    *,
    fused: bool,
    owner: str,
    flag: str = "fuse_wgrad_accumulation",
    offs: torch.Tensor | None = None,
) -> None:
    """Accumulate the masked gradients into ``.grad``, or the weights' into ``main_grad`` when ``fused``.

    Every target is checked before any is written: a failed task writes nothing and can be retried. Fused
    writes honour ``overwrite_main_grad`` and set ``grad_added_to_main_grad`` as
    :func:`~splitgrad.functional.wgrad.write_linear_wgrad` does.

    Args:
        params: the layer's parameters.
        dy: ``(tokens, out)``; x: ``(tokens, in)``; splits: rows per group.
        mask: one entry per parameter of ``params.tensors``.
        fused: weight gradients go into ``main_grad``.
        owner, flag: for error messages (the layer; its name for the fused switch).
        offs: ``grouped_mm``'s offsets of ``splits``, when the caller has them.
    """
    mask_w, mask_b = params.split_mask(mask)
    check_targets(grouped_targets(params, mask, fused=fused), owner=owner, flag=flag)
    if not isinstance(params.weight, torch.Tensor):
        # Checked above (every target, before any write): one group's write is its GEMM and its add.
        rows = list(splits)
        for weight, want, dyg, xg in zip(params.weight, mask_w, torch.split(dy, rows), torch.split(x, rows)):
            if want:
                write_checked_linear_wgrad(weight, dyg, xg, fused=fused)
    elif mask_w[0]:
        weight = params.weight
        if fused:  # main_grad checked above
            beta = 0.0 if getattr(weight, "overwrite_main_grad", False) else 1.0
            grouped_wgrad_into_(weight.main_grad, dy, x, splits, transposed=params.transposed, beta=beta)
            if hasattr(weight, "grad_added_to_main_grad"):
                weight.grad_added_to_main_grad = True
        else:
            accumulate_grad(weight, grouped_wgrad(dy, x, splits, transposed=params.transposed, offs=offs))
    if not any(mask_b):
        return
    bias_grads = grouped_gradients(params, dy, x, splits, (False,) * len(mask_w) + mask_b)[len(mask_w) :]
    for b, grad in zip(params.biases, bias_grads):
        if grad is not None:
            accumulate_grad(b, grad)
