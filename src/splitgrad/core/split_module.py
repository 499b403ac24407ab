"""``SplitModule``: the base class of split layers, with TE's public methods and public extension points.

A subclass declares which of its parameters it writes itself (:meth:`SplitModule.wgrad_parameters`), calls
:meth:`SplitModule.init_split` at the end of ``__init__``, runs its autograd Function through
:meth:`SplitModule.apply_function`, and in the Function's backward hands its weight-gradient work to
:meth:`SplitModule.hand_over_wgrad` — the one place that decides, per parameter, whether the gradient is
returned to autograd now, written by the layer (parked for ``backward_dw`` or written at once into
``main_grad``), or not computed at all because this backward does not ask for it.

Whenever the layer writes a parameter's gradient itself, that parameter carries
``skip_backward_post_hook = True`` and the wgrad hooks fire after the write: that is how a data-parallel
wrapper learns a gradient is ready. See ``docs/core.md`` for a complete custom layer.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .bundle import active_bundle
from .compile import apply_outside_compile
from .placeholder import (
    show_placeholder_grads,
    take_back_placeholder_grads,
    take_back_placeholder_grads_after_backward,
)
from .routing import WgradRoute, wgrad_route
from .store import WeightGradStore
from .task import WgradTask

__all__ = ["SplitModule"]

#: ``mask -> gradients``: one entry per parameter, computed for the True entries, None elsewhere.
GradientsFn = Callable[[tuple[bool, ...]], Sequence[torch.Tensor | None]]
#: ``mask -> None``: writes the True entries' gradients into ``.grad`` / ``main_grad`` (checks before writing).
WriteFn = Callable[[tuple[bool, ...]], None]


class SplitModule(nn.Module):
    """Base of split layers: deferred weight-gradient bookkeeping, hooks, and TE's public methods.

    Extension points (public, documented in ``docs/core.md``): :meth:`init_split`, :meth:`wgrad_parameters`,
    :meth:`apply_function`, :meth:`splits_wgrad`, :meth:`hand_over_wgrad`.
    """

    wgrad_store: WeightGradStore
    fuse_wgrad_accumulation: bool

    # -- extension points ----------------------------------------------------------------------------------
    def init_split(self, *, delay_wgrad_compute: bool, fuse_wgrad_accumulation: bool = False) -> None:
        """Create the store and mark the parameters; call at the end of ``__init__``, once they exist.

        Args:
            delay_wgrad_compute: park the weight gradient for :meth:`backward_dw`.
            fuse_wgrad_accumulation: the layer writes its weight gradient into ``param.main_grad`` itself
                (``write`` of :meth:`hand_over_wgrad` decides how).
        """
        self.fuse_wgrad_accumulation = bool(fuse_wgrad_accumulation)
        self.wgrad_store = WeightGradStore(delay_wgrad_compute, name=type(self).__name__)
        self.refresh_skip_backward_post_hook()

    def wgrad_parameters(self) -> list[nn.Parameter]:
        """Every parameter whose gradient this layer writes itself when splitting (frozen ones included)."""
        raise NotImplementedError(f"{type(self).__name__} must implement wgrad_parameters()")

    def splits_wgrad(self) -> bool:
        """Whether backward hands the weight gradient to :meth:`hand_over_wgrad` (delaying or fusing).

        Decide it in the Function's forward and keep it for its backward: a switch flipped in between cannot
        make autograd drop a gradient.
        """
        return self.need_backward_dw() or self.fuse_wgrad_accumulation

    def apply_function(self, function: type[torch.autograd.Function], *args: object) -> object:
        """``function.apply(*args)``, honouring ``torch.autocast`` and refusing torch DDP.

        A custom Function is opaque to autocast, so under an enabled autocast every floating tensor argument
        (input and parameters alike) is cast to the autocast dtype here and the Function runs with autocast
        off — the same casts autocast would make for ``F.linear``. Gradients written by the layer are cast
        back to each parameter's dtype, or reduced in ``main_grad``'s precision.

        Raises:
            RuntimeError: the layer splits its wgrad inside ``torch.nn.parallel.DistributedDataParallel``'s
                forward (torch DDP's reducer never sees gradients written outside autograd).
        """
        apply = function.apply
        if self.splits_wgrad():
            _refuse_torch_ddp(self)
            apply = functools.partial(apply_outside_compile, function)  # torch.compile: core/compile.py
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        self._check_same_device(tensors[0], tensors[1:])
        device_type = tensors[0].device.type
        # "meta" (deferred initialisation, FSDP2) has no autocast state to query; nothing to cast there.
        if device_type == "meta" or not torch.is_autocast_enabled(device_type):
            return apply(*args)
        dtype = torch.get_autocast_dtype(device_type)
        cast = tuple(
            a.to(dtype) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args
        )
        with torch.autocast(device_type, enabled=False):
            return apply(*cast)

    def _check_same_device(self, x: torch.Tensor, params: Sequence[torch.Tensor]) -> None:
        """``RuntimeError`` naming the module and both devices unless every tensor of ``params`` is on ``x``'s."""
        for p in params:
            if p.device != x.device:
                name = next((n for n, q in self.named_parameters() if q is p), "a parameter")
                raise RuntimeError(
                    f"{self._describe()}: input is on device {x.device} but {name} is on device {p.device}; "
                    f"move the input or the module (module.to({str(x.device)!r})) so they match"
                )

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> SplitModule:
        result = super()._apply(fn, recurse)
        # to_empty() from "meta" (deferred initialisation) and conversions torch cannot do in place swap in new
        # Parameter objects: announce skip_backward_post_hook on them too, or a data-parallel wrapper would
        # also count the gradients the module writes itself.
        if getattr(self, "wgrad_store", None) is not None:
            self.refresh_skip_backward_post_hook()
        return result

    def hand_over_wgrad(
        self,
        params: Sequence[nn.Parameter | None],
        wanted: Sequence[bool],
        *,
        split: bool,
        gradients: GradientsFn,
        write: WriteFn,
        saved: Sequence[torch.Tensor],
        create_graph: bool = False,
    ) -> list[torch.Tensor | None]:
        """Route one backward's weight gradients; call from the autograd Function's backward.

        Per parameter: not split (immediate mode) or asked for by ``torch.autograd.grad`` -> computed now
        with ``gradients`` and returned; accumulated by this backward -> written by the layer with ``write``
        (parked as one task when delaying, run at once otherwise); not asked for by this backward (e.g.
        ``backward(inputs=[x])``) -> nothing computed, nothing parked.

        Args:
            params: the parameters, in the order of the Function's gradient slots (None where absent).
            wanted: per parameter, whether autograd wants its gradient (``ctx.needs_input_grad``).
            split: :meth:`splits_wgrad` as decided at forward.
            gradients: ``mask -> [grad or None]`` with the same arithmetic as ``write`` (bitwise equal modes).
            write: ``mask -> None`` writing the masked gradients; it must check everything before writing
                anything, so a failed task leaves nothing half written and can be retried.
            saved: the tensors ``write`` reads (version-checked when the task runs).
            create_graph: the backward's ``create_graph`` (``ctx.create_graph`` under
                :func:`~splitgrad.core.split_backward`).

        Returns:
            One entry per parameter for the Function to return to autograd (None where nothing is returned).

        Raises:
            RuntimeError: ``create_graph=True`` while this backward accumulates a gradient the layer writes.
        """
        n = len(params)
        want = tuple(bool(w) and p is not None for p, w in zip(params, wanted, strict=True))
        if not any(want):
            return [None] * n
        if not split:
            return list(gradients(want))
        bundle = active_bundle()
        # Memo of the parameters' AccumulateGrad nodes by slot (a plain dict in __dict__: not state, not copied).
        cache = self.__dict__.setdefault("_grad_accumulators", {})
        routes = [
            wgrad_route(p, cache, key=i) if w else WgradRoute.SKIP
            for i, (p, w) in enumerate(zip(params, want))
        ]
        if bundle is not None and bundle.defer_requested:
            routes = [WgradRoute.ACCUMULATE if r is WgradRoute.RETURN else r for r in routes]
        now = tuple(r is WgradRoute.RETURN for r in routes)
        owed = tuple(r is WgradRoute.ACCUMULATE for r in routes)
        if any(owed) and create_graph:
            raise RuntimeError(
                f"{self._describe()}: backward(create_graph=True) through a layer that writes its own weight "
                "gradient (delay_wgrad_compute / fuse_wgrad_accumulation): that gradient would have no graph. "
                "Switch the layer to immediate mode (splitgrad.set_delay_wgrad_compute(model, False), no fused "
                "main_grad) or take torch.autograd.grad w.r.t. its weights"
            )
        out = list(gradients(now)) if any(now) else [None] * n
        if any(owed):
            task = self._wgrad_task(write, owed, params, saved)
            if self.need_backward_dw():
                self.wgrad_store.defer(task)
            else:
                task.run()
        return out

    def _wgrad_task(
        self,
        write: WriteFn,
        owed: tuple[bool, ...],
        params: Sequence[nn.Parameter | None],
        saved: Sequence[torch.Tensor],
    ) -> WgradTask:
        """The task writing the ``owed`` gradients; a fused layer's also shows Megatron-style consumers a
        placeholder ``.grad`` while they look (:mod:`splitgrad.core.placeholder`): from its writes until after
        its hooks for deferred work, until the end of the backward for work done inside it (consumers that
        hook the AccumulateGrad node read it after this backward)."""
        if not self.fuse_wgrad_accumulation:
            return WgradTask(lambda: write(owed), store=self.wgrad_store, label=self._describe, saved=saved)
        written = [p for p, o in zip(params, owed) if o]

        def compute() -> None:
            write(owed)
            show_placeholder_grads(written)

        deferred = self.need_backward_dw()
        release = take_back_placeholder_grads if deferred else take_back_placeholder_grads_after_backward
        return WgradTask(
            compute, store=self.wgrad_store, label=self._describe, saved=saved,
            finish=functools.partial(release, written),
        )  # fmt: skip

    # -- TE's public contract ------------------------------------------------------------------------------
    def need_backward_dw(self) -> bool:
        """True when this module defers its weight gradient to :meth:`backward_dw`."""
        return self.wgrad_store.delay_wgrad_compute()

    def backward_dw(self) -> None:
        """Run the oldest pending wgrad task (one backward's worth), write the gradients, fire the hooks."""
        if len(self.wgrad_store) == 0:
            captured = self.wgrad_store.captured
            hint = f"; {captured} task(s) of it sit in capture_wgrad bundles (run those)" if captured else ""
            raise RuntimeError(
                f"{self._describe()}.backward_dw(): no pending weight-gradient work "
                f"(delay_wgrad_compute={self.need_backward_dw()}; call it once per backward){hint}"
            )
        self.wgrad_store.run_next()

    def register_wgrad_accumulation_and_reduce_hooks(self, hook: Callable[[], None]) -> RemovableHandle:
        """Call ``hook()`` after every completed weight-gradient task of this module.

        Fires after the gradients are written (``.grad`` and ``main_grad`` paths alike): in ``backward_dw``
        when delaying, at the end of backward when ``fuse_wgrad_accumulation`` without delay, never when the
        gradients flow through autograd. Returns a handle with ``.remove()``.
        """
        return self.wgrad_store.hooks.register(hook)

    def get_backward_dw_params(self) -> list[nn.Parameter]:
        """Exactly the parameters :meth:`backward_dw` writes (trainable ones of :meth:`wgrad_parameters`)."""
        return [p for p in self.wgrad_parameters() if p.requires_grad]

    def set_delay_wgrad_compute(self, enabled: bool) -> None:
        """Switch deferral on/off; already pending tasks stay pending and still run via ``backward_dw``."""
        if enabled:
            self.wgrad_store.enable_delay_wgrad_compute()
        else:
            self.wgrad_store.disable_delay_wgrad_compute()
        self.refresh_skip_backward_post_hook()

    def refresh_skip_backward_post_hook(self) -> None:
        """Set ``skip_backward_post_hook`` on :meth:`wgrad_parameters` from :meth:`splits_wgrad`."""
        skip = self.splits_wgrad()
        for param in self.wgrad_parameters():
            param.skip_backward_post_hook = skip

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state.pop("_grad_accumulators", None)  # autograd nodes of the original's parameters
        return state

    def __setstate__(self, state: dict) -> None:
        # deepcopy makes new Parameters without their Python attributes: re-mark them (pickle keeps them).
        super().__setstate__(state)
        if "wgrad_store" in self.__dict__:
            self.refresh_skip_backward_post_hook()

    # -- helpers for subclasses ----------------------------------------------------------------------------
    def _check_last_dim(self, x: torch.Tensor, size: int, name: str) -> None:
        """``ValueError`` naming the module unless ``x`` is ``(..., size)``."""
        if x.dim() == 0 or x.shape[-1] != size:
            raise ValueError(
                f"{self._describe()}: input's last dimension must be {name}={size}, got input shape {tuple(x.shape)}"
            )

    def _describe(self) -> str:
        return f"{type(self).__name__}({self.extra_repr()})"


def _refuse_torch_ddp(owner: SplitModule) -> None:
    # Private torch attribute, read only: the DDP module whose forward is running (torch.compile uses it).
    active = getattr(nn.parallel.DistributedDataParallel, "_get_active_ddp_module", None)
    if active is not None and active() is not None:
        # Described only when refusing: formatting extra_repr on every forward cost a string build per call,
        # and under FSDP2 + torch.compile dynamo cannot trace it (a graph break without splitgrad's reason).
        raise RuntimeError(
            f"{owner._describe()} writes its own weight gradient (delay_wgrad_compute / fuse_wgrad_accumulation) inside "
            "torch.nn.parallel.DistributedDataParallel, whose reducer only sees gradients autograd accumulates: "
            "they would never be reduced. Wrap the model in splitgrad.parallel.DistributedDataParallel instead "
            "(see docs/parallel.md), or use immediate mode"
        )
