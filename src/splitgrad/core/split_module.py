"""The split-backward contract shared by every splitgrad module (TE's names, kept exactly).

A module that mixes in :class:`SplitModule` owns a :class:`~splitgrad.store.WeightGradStore` and declares
which of its parameters have their gradient computed by the module itself (``_deferred_parameters``). Its
autograd Function then calls :meth:`SplitModule._finish_wgrad` with a closure that writes those gradients:

* ``delay_wgrad_compute=True``: the closure is parked (store or capture bundle) and run by ``backward_dw``;
* ``fuse_wgrad_accumulation=True`` without delay: it runs at once inside backward (the weight gradient goes
  into ``main_grad``, bypassing autograd's AccumulateGrad);
* otherwise the Function returns the gradients to autograd like any ``nn.Module``.

In the first two cases the parameters carry ``skip_backward_post_hook = True`` and the wgrad hooks fire after
the gradients are written: that is how a data-parallel wrapper learns a gradient is ready.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .store import WeightGradStore, WgradTask

__all__ = ["SplitModule"]


class SplitModule(nn.Module):
    """Base of splitgrad modules: deferred weight-gradient bookkeeping, hooks, and TE's public methods."""

    wgrad_store: WeightGradStore
    fuse_wgrad_accumulation: bool

    def _init_split(self, *, delay_wgrad_compute: bool, fuse_wgrad_accumulation: bool) -> None:
        """Call at the end of ``__init__``, once the parameters exist."""
        self.fuse_wgrad_accumulation = bool(fuse_wgrad_accumulation)
        self.wgrad_store = WeightGradStore(delay_wgrad_compute, name=type(self).__name__)
        self._refresh_skip_backward_post_hook()

    # -- what subclasses declare ------------------------------------------------------------------------
    def _deferred_parameters(self) -> list[nn.Parameter]:
        """Every parameter whose gradient this module writes itself when splitting (frozen ones included)."""
        raise NotImplementedError

    # -- TE's public contract ---------------------------------------------------------------------------
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
        """Exactly the parameters :meth:`backward_dw` writes (trainable deferred ones), in a stable order."""
        return [p for p in self._deferred_parameters() if p.requires_grad]

    def set_delay_wgrad_compute(self, enabled: bool) -> None:
        """Switch deferral on/off; already pending tasks stay pending and still run via ``backward_dw``."""
        if enabled:
            self.wgrad_store.enable_delay_wgrad_compute()
        else:
            self.wgrad_store.disable_delay_wgrad_compute()
        self._refresh_skip_backward_post_hook()

    # -- helpers for the autograd Functions -------------------------------------------------------------
    def _check_last_dim(self, x: torch.Tensor, size: int, name: str) -> None:
        """``ValueError`` naming the module unless ``x`` is ``(..., size)``."""
        if x.dim() == 0 or x.shape[-1] != size:
            raise ValueError(
                f"{self._describe()}: input's last dimension must be {name}={size}, got input shape {tuple(x.shape)}"
            )

    def _apply_function(self, function: type[torch.autograd.Function], *args: object) -> object:
        """``function.apply(*args)``, honouring ``torch.autocast``.

        A custom Function is opaque to autocast, so under an enabled autocast every floating tensor argument
        (input and parameters alike) is cast to the autocast dtype here and the Function runs with autocast
        off — the same casts autocast would make for ``F.linear``. Gradients written by the module are cast
        back to each parameter's dtype (``accumulate_grad``), or reduced in ``main_grad``'s precision.
        """
        device_type = next(a.device.type for a in args if isinstance(a, torch.Tensor))
        if not torch.is_autocast_enabled(device_type):
            return function.apply(*args)
        dtype = torch.get_autocast_dtype(device_type)
        cast = tuple(
            a.to(dtype) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args
        )
        with torch.autocast(device_type, enabled=False):
            return function.apply(*cast)

    def _splits_wgrad(self) -> bool:
        """Whether backward hands the wgrad to :meth:`_finish_wgrad` instead of returning it to autograd."""
        return self.need_backward_dw() or self.fuse_wgrad_accumulation

    def _finish_wgrad(self, compute: Callable[[], None], saved: Sequence[torch.Tensor]) -> None:
        """Park ``compute`` (delaying) or run it now (fused, immediate); either way hooks fire after it."""
        task = WgradTask(compute, store=self.wgrad_store, label=self._describe(), saved=saved)
        if self.need_backward_dw():
            self.wgrad_store.defer(task)
        else:
            task.run()

    def _refresh_skip_backward_post_hook(self) -> None:
        skip = self._splits_wgrad()
        for param in self._deferred_parameters():
            param.skip_backward_post_hook = skip

    def _describe(self) -> str:
        return f"{type(self).__name__}({self.extra_repr()})"
