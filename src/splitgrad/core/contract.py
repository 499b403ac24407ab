"""The split-capable protocol: what every component asks before treating an object as a split layer.

An object is *split-capable* when it has TE's split-backward methods and owns a
:class:`~splitgrad.core.store.WeightGradStore` (``wgrad_store``). :class:`~splitgrad.core.SplitModule`
subclasses are; so are wrappers that delegate to one (``ops.Linear``). Containers that only fan out to the
split layers inside them (``ops.Sequential``) own no store and are not: whole-model helpers find the layers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from torch import nn
from torch.utils.hooks import RemovableHandle

from .store import WeightGradStore

__all__ = ["SplitCapable", "is_split_capable"]


@runtime_checkable
class SplitCapable(Protocol):
    """TE's split-backward contract plus splitgrad's store (structural: no base class needed)."""

    #: The owner's deferred work, hooks and account of what is owed.
    wgrad_store: WeightGradStore

    def need_backward_dw(self) -> bool:
        """True when the weight gradient is deferred to :meth:`backward_dw`."""
        ...

    def backward_dw(self) -> None:
        """Run the oldest pending wgrad task: write the gradients, then fire the hooks."""
        ...

    def register_wgrad_accumulation_and_reduce_hooks(self, hook: Callable[[], None]) -> RemovableHandle:
        """Call ``hook()`` after every completed weight-gradient task; returns a removable handle."""
        ...

    def get_backward_dw_params(self) -> list[nn.Parameter]:
        """Exactly the parameters :meth:`backward_dw` writes."""
        ...


#: The methods :class:`SplitCapable` requires (besides ``wgrad_store``).
_METHODS = (
    "need_backward_dw",
    "backward_dw",
    "register_wgrad_accumulation_and_reduce_hooks",
    "get_backward_dw_params",
)


def is_split_capable(obj: Any) -> bool:
    """Whether ``obj`` honours :class:`SplitCapable` (the methods, and a ``wgrad_store`` that is a store)."""
    # The same test as isinstance(obj, SplitCapable), spelled out: a runtime-checkable protocol re-derives its
    # member list on every isinstance call, and the whole-model helpers ask this of every submodule several
    # times per training step (a data-parallel step spent ~5 ms of Python in it on an 8-layer model).
    store = getattr(obj, "wgrad_store", None)
    return isinstance(store, WeightGradStore) and all(callable(getattr(obj, m, None)) for m in _METHODS)
