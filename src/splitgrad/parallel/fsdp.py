"""FSDP2 (``fully_shard``) with deferred weight gradients: reduce-scatter at each group's last W.

FSDP2 reduce-scatters a parameter group's gradients in its post-backward hook. With
``delay_wgrad_compute=True`` the weight gradients do not exist yet then; they are written at ``backward_dw``,
onto a resharded module whose parameters are sharded DTensors. :func:`defer_fsdp_reduction` closes the gap,
the way Megatron's DDP uses TE's hooks:

* around every deferred task of a split layer inside an FSDP2 group, the group's *unsharded* parameters are
  put back on the layer (no all-gather: only their ``.grad`` is written, never their data);
* after each task (the wgrad hook) its gradients are moved aside, in the group's reduce dtype, as FSDP2 itself
  accumulates across backwards, so FSDP2's own post-backward never sees them half done;
* when the group owes no more wgrad work and gradient sync is on (``set_requires_gradient_sync``), the
  gradients go through FSDP2's own reduce-scatter (same buckets, divide factor, reduce dtype, accumulation into
  the sharded ``.grad``) exactly once.

Parameters not written by deferred tasks (immediate-mode layers, plain torch modules) keep FSDP2's own path.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from ..core import is_split_capable
from ._fsdp2_private import (
    check_supported,
    fsdp_param_groups,
    hand_back,
    module_fsdp_params,
    reduce_group_now,
    unsharded_on_module,
    unsharded_param,
)

__all__ = ["FSDPReductionHandle", "defer_fsdp_reduction"]

logger = logging.getLogger(__name__)


class _DeferredGroup:
    """One FSDP2 parameter group with split layers in it, and the deferred gradients held for its reduction."""

    def __init__(self, group: object, name: str) -> None:
        self.group = group
        self.name = name
        self.layers: list[nn.Module] = []
        self.held: dict[object, torch.Tensor] = {}

    def owed(self) -> int:
        return sum(layer.wgrad_store.outstanding.total for layer in self.layers)

    def after_task(self, layer: nn.Module, params: dict[str, object]) -> None:
        """The wgrad hook: move the task's gradients aside, then reduce if this was the group's last task."""
        written = {id(p) for p in layer.get_backward_dw_params()}
        for name, fsdp_param in params.items():
            unsharded = unsharded_param(fsdp_param)
            if unsharded is None or unsharded.grad is None:
                continue
            # get_backward_dw_params() reads the layer's attributes, which hold the sharded parameter again.
            if id(layer._parameters.get(name)) not in written and id(unsharded) not in written:
                continue
            grad, unsharded.grad = unsharded.grad, None
            reduce_dtype = getattr(fsdp_param, "reduce_dtype", None)
            if reduce_dtype is not None and grad.dtype != reduce_dtype:
                grad = grad.to(reduce_dtype)  # FSDP2 accumulates across backwards in the reduce dtype too
            if fsdp_param in self.held:
                self.held[fsdp_param].add_(grad)
            else:
                self.held[fsdp_param] = grad
        if self.held and self.group.reduce_grads and self.owed() == 0:
            logger.debug(
                "%s: last deferred wgrad task ran; reduce-scattering %d gradients", self.name, len(self.held)
            )
            held, self.held = self.held, {}
            reduce_group_now(self.group, held)


class FSDPReductionHandle:
    """Returned by :func:`defer_fsdp_reduction`; ``remove()`` uninstalls the hooks."""

    def __init__(self, groups: list[_DeferredGroup], handles: list) -> None:
        self._groups = groups
        self._handles = handles

    @property
    def held_gradients(self) -> int:
        """Deferred gradients written but not reduced yet (gradient sync off, or W work still owed)."""
        return sum(len(g.held) for g in self._groups)

    def release_to_fsdp(self) -> int:
        """Hand every held gradient back to FSDP2, whose next ``post_backward`` reduces it.

        For callers that drive FSDP2's reduction themselves after the last W, such as
        ``torch.distributed.pipelining``'s ``REDUCE_GRAD`` action (the splitgrad adapter calls this first).

        Returns:
            The number of gradients handed back.
        """
        n = 0
        for g in self._groups:
            held, g.held = g.held, {}
            for fsdp_param, grad in held.items():
                hand_back(fsdp_param, grad)
                n += 1
        return n

    def remove(self) -> None:
        """Uninstall; refuses while gradients are held for a reduction that would then never happen.

        Raises:
            RuntimeError: gradients are held (name the groups); reduce them first (sync on, ``backward_dw``).
        """
        holding = [g.name for g in self._groups if g.held]
        if holding:
            raise RuntimeError(
                f"defer_fsdp_reduction handle: FSDP groups {holding} hold deferred gradients not reduced yet "
                "(gradient sync off, or wgrad work still owed); removing now would lose them"
            )
        for handle in self._handles:
            handle.remove()
        self._handles = []
        for g in self._groups:
            for layer in g.layers:
                layer.__dict__.pop("_splitgrad_fsdp_deferred", None)
        self._groups = []


def defer_fsdp_reduction(model: nn.Module) -> FSDPReductionHandle:
    """Make FSDP2 reduce-scatter deferred weight gradients when each group's last wgrad task has run.

    Call after ``fully_shard`` (and before the first backward whose W work you defer). Afterwards
    ``splitgrad.backward_dw(model)`` leaves the sharded DTensor ``.grad`` equal to immediate mode.

    Args:
        model: a module tree containing ``fully_shard``-ed modules and splitgrad split layers.

    Returns:
        A handle; ``.remove()`` uninstalls, ``.held_gradients`` counts gradients awaiting their reduction.

    Raises:
        ValueError: no FSDP2 module in ``model``; a split layer uses ``fuse_wgrad_accumulation`` (FSDP2 owns
            the gradient buffers, there is no ``main_grad``); a layer's parameters span several FSDP2 groups;
            the model is already set up.
        RuntimeError: this torch's FSDP2 lacks an internal name the glue needs (named).
    """
    from torch.distributed.fsdp import FSDPModule

    fsdp_modules = [(name, m) for name, m in model.named_modules() if isinstance(m, FSDPModule)]
    if not fsdp_modules:
        raise ValueError(
            f"defer_fsdp_reduction: {type(model).__name__} contains no fully_shard-ed module; call "
            "torch.distributed.fsdp.fully_shard first"
        )
    for _, module in fsdp_modules:
        check_supported(module)
    groups: dict[int, _DeferredGroup] = {}
    handles: list = []
    plans = []
    layers_by_handle: list[nn.Module] = []
    for layer_name, layer in model.named_modules():
        if not is_split_capable(layer) or not isinstance(layer, nn.Module):
            continue
        found = [
            (fsdp_name, group, params)
            for fsdp_name, module in fsdp_modules
            for group in fsdp_param_groups(module)
            if (params := module_fsdp_params(group, layer))
        ]
        if not found:
            continue  # not sharded by FSDP2: nothing to do
        label = layer_name or type(layer).__name__
        if len(found) > 1:
            raise ValueError(
                f"defer_fsdp_reduction: {label}'s parameters span {len(found)} FSDP2 groups "
                f"({[f[0] for f in found]}); shard each split layer with exactly one fully_shard call"
            )
        if getattr(layer, "fuse_wgrad_accumulation", False):
            raise ValueError(
                f"defer_fsdp_reduction: {label} has fuse_wgrad_accumulation=True; under FSDP2 gradients live "
                "in FSDP2's sharded .grad (there is no main_grad buffer). Use fuse_wgrad_accumulation=False"
            )
        if layer.__dict__.get("_splitgrad_fsdp_deferred"):
            raise ValueError(f"defer_fsdp_reduction: {label} is already set up (remove the first handle)")
        fsdp_name, group, params = found[0]
        plans.append((layer, group, params, fsdp_name))
    for layer, group, params, fsdp_name in plans:
        deferred = groups.get(id(group))
        if deferred is None:
            deferred = groups[id(group)] = _DeferredGroup(group, fsdp_name or type(model).__name__)
        deferred.layers.append(layer)
        layer.__dict__["_splitgrad_fsdp_deferred"] = True
        layers_by_handle.append(layer)
        handles.append(
            layer.wgrad_store.compute_contexts.register(
                lambda layer=layer, params=params: unsharded_on_module(layer, params)
            )
        )
        handles.append(
            layer.register_wgrad_accumulation_and_reduce_hooks(
                lambda d=deferred, layer=layer, params=params: d.after_task(layer, params)
            )
        )
    logger.debug("defer_fsdp_reduction: %d split layers in %d FSDP2 groups", len(plans), len(groups))
    result = FSDPReductionHandle(list(groups.values()), handles)
    for layer in layers_by_handle:
        layer.__dict__["_splitgrad_fsdp_deferred"] = (
            result  # found by the torch.distributed.pipelining adapter
        )
    return result
