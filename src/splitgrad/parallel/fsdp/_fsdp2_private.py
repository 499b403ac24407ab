"""Every private FSDP2 name splitgrad touches, in one place.

Why private names at all: FSDP2 (``torch.distributed.fsdp.fully_shard``) reduce-scatters a parameter group's
gradients in its post-backward hook, once autograd finished the group's backward. A deferred weight gradient
is written later, at ``backward_dw``, when that hook has already run and the group is resharded. FSDP2 has no
public "reduce this group now" call, so :mod:`splitgrad.parallel.fsdp` drives the group's own
``post_backward`` (same buckets, divide factors, reduce dtype and sharded-gradient accumulation as immediate
mode) and writes into the group's unsharded parameters. If a torch version lacks one of these names,
:func:`check_supported` says so before anything is written.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

__all__ = [
    "FSDPParamLike",
    "check_supported",
    "fsdp_param_groups",
    "hand_back",
    "module_fsdp_params",
    "reduce_group_now",
    "unsharded_on_module",
    "unsharded_param",
]

#: FSDP2's per-parameter record (``FSDPParam``); typed loosely because it is private.
FSDPParamLike = object

_GROUP_ATTRS = (
    "fsdp_params",
    "post_backward",
    "reduce_grads",
    "all_reduce_grads",
    "reshard_after_backward",
    "_training_state",
    "_partial_reduce_output",
)
_PARAM_ATTRS = ("_module_info",)  # the dtype attributes appear at FSDP2's lazy init


def check_supported(module: nn.Module) -> None:
    """Raise a ``RuntimeError`` naming what is missing when this torch's FSDP2 lacks a name used here."""
    try:
        from torch.distributed.fsdp import FSDPModule  # noqa: F401
    except ImportError as exc:  # pragma: no cover - torch builds without distributed
        raise RuntimeError(
            f"defer_fsdp_reduction needs torch.distributed.fsdp.FSDPModule (torch {torch.__version__})"
        ) from exc
    if not hasattr(module, "_get_fsdp_state"):
        raise RuntimeError(
            f"defer_fsdp_reduction: {type(module).__name__} has no _get_fsdp_state(); torch {torch.__version__}'s "
            "FSDP2 is not the version splitgrad supports (tested with torch 2.13)"
        )
    for group in fsdp_param_groups(module):
        missing = [a for a in _GROUP_ATTRS if not hasattr(group, a)]
        for fsdp_param in group.fsdp_params:
            missing += [a for a in _PARAM_ATTRS if not hasattr(fsdp_param, a)]
        if missing:
            raise RuntimeError(
                f"defer_fsdp_reduction: torch {torch.__version__}'s FSDP2 param group lacks {sorted(set(missing))}; "
                "splitgrad's FSDP2 glue supports the FSDP2 of torch 2.13"
            )


def fsdp_param_groups(module: nn.Module) -> list:
    """The ``FSDPParamGroup`` objects of one ``fully_shard``-ed module (empty when it manages no parameter)."""
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:  # older torch: one group per state
        group = getattr(state, "_fsdp_param_group", None)
        groups = [] if group is None else [group]
    return list(groups)


def module_fsdp_params(group: object, module: nn.Module) -> dict[str, FSDPParamLike]:
    """``{parameter name on module: FSDPParam}`` for the parameters of ``group`` registered on ``module``."""
    out = {}
    for fsdp_param in group.fsdp_params:
        info = fsdp_param._module_info
        if info.module is module:
            out[info.param_name] = fsdp_param
        for shared, name in zip(info.shared_modules, info.shared_param_names, strict=False):
            if shared is module:
                out[name] = fsdp_param
    return out


def unsharded_param(fsdp_param: FSDPParamLike) -> nn.Parameter | None:
    """The unsharded parameter autograd writes (None before FSDP2's lazy init created it).

    Its storage may be freed (resharded): only its ``.grad`` is written, never its data.
    """
    return getattr(fsdp_param, "_unsharded_param", None)


@contextlib.contextmanager
def unsharded_on_module(module: nn.Module, params: dict[str, FSDPParamLike]) -> Iterator[None]:
    """Register the unsharded parameters on ``module`` for the duration of the block, then put back what was there.

    FSDP2 swaps module attributes the same way (``unsafe_setattr_param``): a plain ``_parameters`` entry.
    """
    saved = {}
    for name, fsdp_param in params.items():
        unsharded = unsharded_param(fsdp_param)
        if unsharded is not None and module._parameters.get(name) is not unsharded:
            saved[name] = module._parameters[name]
            module._parameters[name] = unsharded
    try:
        yield
    finally:
        for name, param in saved.items():
            module._parameters[name] = param


def reduce_group_now(
    group: object,
    grads: dict[FSDPParamLike, torch.Tensor],
    *,
    all_reduce: bool,
    partial: torch.Tensor | None,
) -> torch.Tensor | None:
    """Reduce-scatter ``grads`` (full, unsharded) into their sharded ``.grad`` through FSDP2's own path.

    Under HSDP (a 2-D mesh) FSDP2 then all-reduces the reduce-scattered gradient over the replicate dim, or, with
    ``all_reduce=False``, adds it to a partial sum that a later reduction all-reduces.

    Args:
        group: the ``FSDPParamGroup``.
        grads: per FSDPParam the full gradient, in the parameter's unsharded dtype or already in the group's
            reduce dtype (FSDP2's "accumulated" form).
        all_reduce: HSDP's ``all_reduce_grads`` as it was when the group's last W ran (the caller's snapshot:
            the user may have changed the flag since).
        partial: the deferred gradients' own HSDP partial sum, ``(sum of shard numels,)`` flat, from an earlier
            reduction with ``all_reduce=False``, or None. Kept apart from FSDP2's: that one holds the
            parameters FSDP2 reduced at backward, a different subset with a different flat layout.

    Returns:
        The new partial sum (None once all-reduced, and always None without a replicate dim).

    The group is left sharded or unsharded as it was, and its gradient-sync flags as they were: resharding and
    the flags are FSDP2's (and the user's) business.
    """
    for fsdp_param, grad in grads.items():
        unsharded = unsharded_param(fsdp_param)
        if grad.dtype != unsharded.dtype:
            fsdp_param.unsharded_accumulated_grad = grad
        else:
            unsharded.grad = grad
    saved = (
        group._training_state,
        group.reshard_after_backward,
        group.reduce_grads,
        group.all_reduce_grads,
        group._partial_reduce_output,
    )
    rs_states = group.comm_ctx.reduce_scatter_states
    n_states = len(rs_states)
    group.reshard_after_backward = False
    # The decision to reduce was taken at the last W (sync on then); the flags may have changed since.
    group.reduce_grads, group.all_reduce_grads = True, all_reduce
    group._partial_reduce_output = partial
    try:
        # The class's method, not the attribute: defer_fsdp_reduction(mode="async") wraps the attribute with a
        # wait for this very reduction.
        type(group).post_backward(group)
        group._wait_for_post_backward()
        partial = group._partial_reduce_output
    finally:
        (
            group._training_state,
            group.reshard_after_backward,
            group.reduce_grads,
            group.all_reduce_grads,
            group._partial_reduce_output,
        ) = saved
    # Release the reduce-scatter input this call queued (FSDP2 drops its own at the end of the last backward,
    # which already ran): wait for it, then let the allocator reuse it.
    while len(rs_states) > n_states:
        event = rs_states.pop().event
        if event is not None:
            group.device_handle.current_stream().wait_event(event)
    return partial


def hand_back(fsdp_param: FSDPParamLike, grad: torch.Tensor) -> None:
    """Give a held full gradient back to FSDP2, where its next ``post_backward`` reduces it with the rest.

    A gradient already in the reduce dtype joins FSDP2's accumulated gradient; one in the parameter's dtype
    joins the unsharded parameter's ``.grad``.
    """
    unsharded = unsharded_param(fsdp_param)
    if grad.dtype != unsharded.dtype:
        if fsdp_param.unsharded_accumulated_grad is None:
            fsdp_param.unsharded_accumulated_grad = grad
        else:
            fsdp_param.unsharded_accumulated_grad += grad
    elif unsharded.grad is None:
        unsharded.grad = grad
    else:
        unsharded.grad += grad
