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
  the sharded ``.grad``) exactly once. ``mode`` says when: inside that last task (``"last_w"``), at
  :meth:`FSDPReductionHandle.finish` (``"finish"``: the pipeline's ``RF`` action, its own timeline event), or
  on a background thread started there and joined at ``finish()`` (``"async"``: overlaps the remaining work).

Under HSDP (a 2-D mesh) that same reduction also all-reduces over the replicate dim; the reduction uses the
gradient-sync flags of the group's last W (``set_requires_gradient_sync``, ``set_requires_all_reduce``),
whenever it runs.

Parameters not written by deferred tasks (immediate-mode layers, plain torch modules) keep FSDP2's own path.
"""

from __future__ import annotations

import collections
import logging
import time
from typing import Literal

import torch
from torch import nn

from ...core import is_split_capable
from ._fsdp2_private import (
    check_supported,
    fsdp_param_groups,
    hand_back,
    module_fsdp_params,
    reduce_group_now,
    unsharded_on_module,
    unsharded_param,
)
from .background import BackgroundReducer

__all__ = ["FSDPReductionHandle", "ReductionMode", "defer_fsdp_reduction", "fsdp_reduction_handle"]

logger = logging.getLogger(__name__)

ReductionMode = Literal["last_w", "finish", "async"]
_MODES = ("last_w", "finish", "async")
_MAX_EVENTS = 1024
_FLAG_SETTERS = ("set_requires_gradient_sync", "set_requires_all_reduce")
# Where a set-up split layer records its handle (read only through fsdp_reduction_handle).
_HANDLE_ATTR = "_splitgrad_fsdp_reduction"


class _DeferredGroup:
    """One FSDP2 parameter group with split layers in it, and the deferred gradients held for its reduction."""

    def __init__(self, group: object, name: str, on_ready) -> None:
        self.group = group
        self.name = name
        self.layers: list[nn.Module] = []
        self.held: dict[object, torch.Tensor] = {}
        # HSDP: the deferred gradients reduce-scattered but not yet all-reduced (set_requires_all_reduce(False)).
        self.partial: torch.Tensor | None = None
        self.on_ready = on_ready

    def owed(self) -> int:
        return sum(layer.wgrad_store.outstanding.total for layer in self.layers)

    def reduce(self, held: dict, all_reduce: bool) -> None:
        """FSDP2's reduction of ``held`` (and, under HSDP, of the partial sum with ``all_reduce``)."""
        self.partial = reduce_group_now(self.group, held, all_reduce=all_reduce, partial=self.partial)

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
            logger.debug("%s: last deferred wgrad task ran; %d gradients ready", self.name, len(self.held))
            held, self.held = self.held, {}
            self.on_ready(self, held)


class FSDPReductionHandle:
    """Returned by :func:`defer_fsdp_reduction`; ``finish()`` completes the reductions, ``remove()`` uninstalls."""

    def __init__(self, mode: ReductionMode, name: str, *, timeout: float) -> None:
        self.mode = mode
        self._groups: list[_DeferredGroup] = []
        self._handles: list = []
        # (group, gradients, HSDP all_reduce_grads at its last W), for finish()
        self._ready: list[tuple[_DeferredGroup, dict, bool]] = []
        # Bounded: nobody pops them outside the pipeline runtime; keep the latest few steps' worth.
        self._events: collections.deque[tuple[str, float, float]] = collections.deque(maxlen=_MAX_EVENTS)
        self._reducer = (
            BackgroundReducer(f"defer_fsdp_reduction({name})", timeout=timeout, max_events=_MAX_EVENTS)
            if mode == "async"
            else None
        )

    def _on_ready(self, group: _DeferredGroup, held: dict) -> None:
        """A group's last W ran with sync on: reduce now, hold for ``finish()``, or start in the background."""
        label = f"reduce-scatter {group.name}"
        # Snapshot: FSDP2 reads the flag at its post_backward; ours is this last W, whenever the reduction runs.
        all_reduce = bool(group.group.all_reduce_grads)
        if self.mode == "last_w":
            self._timed(label, lambda: group.reduce(held, all_reduce))
        elif self.mode == "finish":
            self._ready.append((group, held, all_reduce))
        else:
            self._reducer.submit(label, lambda: group.reduce(held, all_reduce))

    def _timed(self, label: str, reduce) -> None:
        start = time.perf_counter()
        reduce()
        self._events.append((label, start, time.perf_counter()))

    @property
    def held_gradients(self) -> int:
        """Deferred gradients written but not reduced yet (gradient sync off, W work still owed, or waiting for
        ``finish()``); gradients of a background reduction in flight are not counted (see ``in_flight``)."""
        return sum(len(g.held) for g in self._groups) + sum(len(held) for _, held, _ in self._ready)

    @property
    def in_flight(self) -> int:
        """Background reductions (``mode="async"``) started and not yet joined by ``finish()``."""
        return 0 if self._reducer is None else self._reducer.pending

    def finish(self) -> None:
        """Complete every reduction that is due: run the held ones (``"finish"``), join the background ones
        (``"async"``). Afterwards the sharded ``.grad`` holds them. Gradients still owed W work, or held with
        gradient sync off, stay held.

        Raises:
            RuntimeError: a background reduction failed or timed out (named).
        """
        ready, self._ready = self._ready, []
        for group, held, all_reduce in ready:
            self._timed(
                f"reduce-scatter {group.name}",
                lambda group=group, held=held, all_reduce=all_reduce: group.reduce(held, all_reduce),
            )
        if self._reducer is not None:
            self._reducer.wait()

    def pop_comm_events(self) -> list[tuple[str, float, float]]:
        """The reduce-scatters run since the last call, as ``(label, start, end)`` in ``time.perf_counter()``
        seconds (``"async"``: those joined by ``finish()``); the pipeline runtime puts them on its timeline."""
        events = list(self._events)
        self._events.clear()
        if self._reducer is not None:
            events += self._reducer.events
            self._reducer.events.clear()
        return sorted(events, key=lambda e: e[1])

    def release_to_fsdp(self) -> int:
        """Hand every held gradient back to FSDP2, whose next ``post_backward`` reduces it.

        For callers that drive FSDP2's reduction themselves after the last W, such as
        ``torch.distributed.pipelining``'s ``REDUCE_GRAD`` action (the splitgrad adapter calls this first).

        Returns:
            The number of gradients handed back.

        Raises:
            RuntimeError: under HSDP, deferred gradients were reduce-scattered without their all-reduce
                (``set_requires_all_reduce(False)``): FSDP2's own partial sum has another layout.
        """
        self.finish_background()
        partial = [g.name for g in self._groups if g.partial is not None]
        if partial:
            raise RuntimeError(
                f"defer_fsdp_reduction handle: FSDP groups {partial} hold reduce-scattered deferred gradients "
                "awaiting their HSDP all-reduce (set_requires_all_reduce(False)); they cannot be handed back to "
                "FSDP2: all-reduce on the last microbatch before release_to_fsdp()"
            )
        ready, self._ready = self._ready, []
        n = 0
        for g, held in [(g, g.held) for g in self._groups] + [(g, held) for g, held, _ in ready]:
            g.held = {}
            for fsdp_param, grad in held.items():
                hand_back(fsdp_param, grad)
                n += 1
        return n

    def finish_background(self) -> None:
        """Join the background reductions only (``"async"``; a no-op otherwise); FSDP2's next use waits so."""
        if self._reducer is not None and self._reducer.pending:
            self._reducer.wait()

    def remove(self) -> None:
        """Uninstall; refuses while gradients are held for a reduction that would then never happen.

        Raises:
            RuntimeError: gradients are held (name the groups); reduce them first (sync on, ``backward_dw``,
                ``finish()``).
        """
        holding = [g.name for g in self._groups if g.held or g.partial is not None]
        holding += [g.name for g, _, _ in self._ready]
        if holding:
            raise RuntimeError(
                f"defer_fsdp_reduction handle: FSDP groups {holding} hold deferred gradients not reduced yet "
                "(gradient sync off, wgrad work still owed, finish() not called, or an HSDP all-reduce skipped by "
                "set_requires_all_reduce(False)); removing now would lose them"
            )
        if self._reducer is not None:
            self._reducer.close()
            self._reducer = None
        for handle in self._handles:
            handle.remove()
        self._handles = []
        for g in self._groups:
            for layer in g.layers:
                layer.__dict__.pop(_HANDLE_ATTR, None)
        self._groups = []


class _InstanceAttr:
    """A removable handle for an instance attribute that shadows a method (``post_backward`` wrappers)."""

    def __init__(self, obj: object, name: str) -> None:
        self.obj, self.name = obj, name

    def remove(self) -> None:
        self.obj.__dict__.pop(self.name, None)


def _wait_first(handle: FSDPReductionHandle, obj: object, method: str):
    """``obj.<method>`` that first joins ``handle``'s background reductions, then runs the class's method."""

    def wrapped(*args: object, **kwargs: object) -> object:
        handle.finish_background()
        return getattr(type(obj), method)(obj, *args, **kwargs)

    return wrapped


def defer_fsdp_reduction(
    model: nn.Module, *, mode: ReductionMode = "last_w", timeout: float = 300.0
) -> FSDPReductionHandle:
    """Make FSDP2 reduce-scatter deferred weight gradients when each group's last wgrad task has run.

    Call after ``fully_shard`` (and before the first backward whose W work you defer). Afterwards
    ``splitgrad.backward_dw(model)`` (then ``handle.finish()`` unless ``mode="last_w"``) leaves the sharded
    DTensor ``.grad`` equal to immediate mode.

    Args:
        model: a module tree containing ``fully_shard``-ed modules (1-D mesh, or a 2-D HSDP mesh) and
            splitgrad split layers.
        mode: when a group whose last W ran (gradient sync on) is reduce-scattered: ``"last_w"`` inside that
            task; ``"finish"`` at ``handle.finish()``; ``"async"`` on a background thread started then (with
            its own reduce-scatter process group, ``set_separate_reduce_scatter_group``), joined by
            ``handle.finish()``, by the model's next forward, by FSDP2's next ``post_backward`` of the
            model, or by ``set_requires_gradient_sync``/``set_requires_all_reduce`` on its FSDP2 modules.
            With ``"async"``, read ``.grad`` (``clip_grad_norm_``, ``optimizer.step()``) only after
            ``finish()``.
        timeout: seconds ``finish()`` waits for each background reduction (``"async"``).

    Returns:
        A handle; ``.remove()`` uninstalls, ``.held_gradients`` counts gradients awaiting their reduction.

    Raises:
        ValueError: no FSDP2 module in ``model``; a split layer uses ``fuse_wgrad_accumulation`` (FSDP2 owns
            the gradient buffers, there is no ``main_grad``); a layer's parameters span several FSDP2 groups;
            the model is already set up.
        RuntimeError: this torch's FSDP2 lacks an internal name the glue needs (named).
    """
    from torch.distributed.fsdp import FSDPModule

    if mode not in _MODES:
        raise ValueError(f"defer_fsdp_reduction: mode must be one of {_MODES}, got {mode=}")
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
        if fsdp_reduction_handle(layer) is not None:
            raise ValueError(f"defer_fsdp_reduction: {label} is already set up (remove the first handle)")
        fsdp_name, group, params = found[0]
        plans.append((layer, group, params, fsdp_name))
    result = FSDPReductionHandle(mode, type(model).__name__, timeout=timeout)
    for layer, group, params, fsdp_name in plans:
        deferred = groups.get(id(group))
        if deferred is None:
            deferred = groups[id(group)] = _DeferredGroup(
                group, fsdp_name or type(model).__name__, result._on_ready
            )
        deferred.layers.append(layer)
        layer.__dict__[_HANDLE_ATTR] = result
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
    if mode == "async" and groups:
        _own_reduce_scatter_group(fsdp_modules)
        # Every FSDP2 reduction of this model runs on that process group: FSDP2's own first joins the background.
        for _, module in fsdp_modules:
            for group in fsdp_param_groups(module):
                group.post_backward = _wait_first(result, group, "post_backward")
                handles.append(_InstanceAttr(group, "post_backward"))
            # A background reduction sets the group's sync flags for its duration (the values of its last W)
            # and puts them back: a flag the user changes meanwhile would be lost. Join first.
            for setter in _FLAG_SETTERS:
                module.__dict__[setter] = _wait_first(result, module, setter)
                handles.append(_InstanceAttr(module, setter))
        # prepend: join before FSDP2's own pre-forward touches the groups.
        handles.append(model.register_forward_pre_hook(lambda *_: result.finish_background(), prepend=True))
    logger.debug(
        "defer_fsdp_reduction: %d split layers in %d FSDP2 groups (%s)", len(plans), len(groups), mode
    )
    result._groups, result._handles = list(groups.values()), handles
    return result


def fsdp_reduction_handle(layer: nn.Module) -> FSDPReductionHandle | None:
    """The handle of the :func:`defer_fsdp_reduction` call that manages ``layer``'s deferred gradients.

    For code that drives FSDP2's reduction itself and must first take the deferred gradients back from
    splitgrad (``handle.release_to_fsdp()``), such as the ``torch.distributed.pipelining`` adapter's
    ``REDUCE_GRAD``.

    Args:
        layer: a module, usually a split layer (``splitgrad.Linear``, an op, ...).

    Returns:
        The handle, or None: ``layer`` is not a split layer inside a ``fully_shard``-ed group that
        :func:`defer_fsdp_reduction` set up, or that handle was removed (``handle.remove()``).
    """
    handle = layer.__dict__.get(_HANDLE_ATTR)
    return handle if isinstance(handle, FSDPReductionHandle) else None


def _own_reduce_scatter_group(fsdp_modules: list[tuple[str, nn.Module]]) -> None:
    """Give the outermost FSDP2 modules (and so all below) a reduce-scatter process group of their own.

    A background reduce-scatter then never shares a process group with an all-gather the main thread issues
    (gloo runs a group's collectives in call order; two threads calling one group could pair different
    collectives across ranks). Collective over each shard group (``new_group(use_local_synchronization=True)``).
    """
    names = [name for name, _ in fsdp_modules]
    for name, module in fsdp_modules:
        if not any(other != name and (other == "" or name.startswith(other + ".")) for other in names):
            module.set_separate_reduce_scatter_group(True)
