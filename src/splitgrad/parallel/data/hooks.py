"""The wrapper's hooks: installed on parameters and wgrad stores, holding their target only weakly.

The hooks live on the parameters and stores, which the wrapper reaches through its module: a hook holding the
wrapper's gradient sync strongly makes a cycle through C++ (the parameters' hook tables) that Python's gc
cannot see, so the wrapper, and with it the process group, would never be freed. The group then outlives
destroy_process_group() and gloo aborts the process at exit. So every hook holds a weak reference.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

from ...core import split_modules

__all__ = ["detach", "install_hooks", "weak_hook"]


def install_hooks(
    module: nn.Module,
    params: Sequence[nn.Parameter],
    index_of: dict[int, int],
    *,
    on_autograd_grad: Callable[[int, nn.Parameter], None],
    on_wgrad: Callable[[tuple[int, ...]], None],
) -> list[Any]:
    """Register the readiness hooks; returns their handles.

    Args:
        module: the wrapped model (its split-capable submodules get a wgrad hook each, one per store).
        params: the managed parameters, by index; each gets a post-accumulate-grad hook.
        index_of: ``id(param) -> index`` into ``params``.
        on_autograd_grad: bound method called as ``(index, param)`` after autograd accumulated ``param``.
        on_wgrad: bound method called with the indices a store's owner wrote, after each wgrad task.
    """
    handles: list[Any] = []
    for i, p in enumerate(params):
        p.grad_added_to_main_grad = False
        handles.append(p.register_post_accumulate_grad_hook(weak_hook(on_autograd_grad, i)))
    # One hook per store: a composite op exposes its inner op's store (and hooks) as its own, and
    # registering on both would count every contribution twice.
    owners: dict[int, tuple[nn.Module, list[int]]] = {}
    for _, owner in split_modules(module):
        _, owned = owners.setdefault(id(owner.wgrad_store), (owner, []))
        for p in owner.get_backward_dw_params():
            idx = index_of.get(id(p))
            if idx is not None and idx not in owned:
                owned.append(idx)
    for owner, owned in owners.values():
        if owned:
            hook = weak_hook(on_wgrad, tuple(owned))
            handles.append(owner.register_wgrad_accumulation_and_reduce_hooks(hook))
    return handles


def weak_hook(method: Callable[..., None], *bound: Any) -> Callable[..., None]:
    """``method(*bound, *args)`` through a weak reference to ``method``'s object (a no-op once it is gone)."""
    ref = weakref.WeakMethod(method)

    def hook(*args: Any) -> None:
        target = ref()
        if target is not None:
            target(*bound, *args)

    return hook


def detach(handles: list[Any], params: list[nn.Parameter]) -> None:
    """Remove the hooks (emptying ``handles`` in place) and the attributes the wrapper set on ``params``."""
    for handle in handles:
        handle.remove()
    handles.clear()
    for p in params:
        for attr in ("main_grad", "grad_added_to_main_grad"):
            if hasattr(p, attr):
                delattr(p, attr)
