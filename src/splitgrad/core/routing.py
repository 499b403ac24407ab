"""Where one backward sends a split layer's weight gradient: accumulate it later, return it now, or nowhere.

Plain autograd writes ``param.grad`` only when the current backward executes the parameter's AccumulateGrad
node: ``loss.backward()`` and ``loss.backward(inputs=[w])`` do, ``loss.backward(inputs=[x])`` and
``torch.autograd.grad(loss, [x])`` do not, and ``torch.autograd.grad(loss, [w])`` *captures* the gradient and
returns it without touching ``w.grad``. A layer that writes its own weight gradient must follow the same rule,
so it asks the engine per parameter (:func:`wgrad_route`) before parking any work.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch.autograd.function import once_differentiable

__all__ = ["WgradRoute", "split_backward", "wgrad_route"]


class WgradRoute(enum.Enum):
    """What the current backward does with one parameter's gradient."""

    #: It accumulates into ``param.grad`` (``backward()``): the layer writes it itself, now or deferred.
    ACCUMULATE = "accumulate"
    #: ``torch.autograd.grad`` asked for it: compute it now and return it to autograd.
    RETURN = "return"
    #: This backward does not compute it at all (``backward(inputs=[x])``, ``autograd.grad(loss, [x])``).
    SKIP = "skip"


def wgrad_route(
    param: torch.Tensor, cache: dict[int, Any] | None = None, key: int | None = None
) -> WgradRoute:
    """Ask the autograd engine what the running backward does with ``param``'s gradient.

    Must be called from inside a backward pass (an autograd Function's ``backward``).

    Args:
        param: a leaf tensor (a parameter) that requires grad.
        cache: the caller's ``{key: AccumulateGrad node}`` memo (finding the node costs a view op); an entry
            for another tensor is replaced, and a stale one (the parameter's accumulator was replaced) is never
            in the running graph, so an answer of SKIP is re-checked with a fresh node.
        key: the parameter's slot in ``cache`` (default ``id(param)``); a fixed slot per parameter keeps the
            memo from holding replaced parameters alive.

    Raises:
        RuntimeError: this torch has no way to ask (then splitting cannot know what is owed, and refuses
            rather than park work no backward asked for).
    """
    # Private engine call, on purpose and only here: torch has no public query for "will this backward
    # accumulate into this leaf?" (torch.utils.checkpoint and register_multi_grad_hook use the same call).
    will_execute = getattr(torch._C, "_will_engine_execute_node", None)
    if will_execute is None:
        raise RuntimeError(
            f"torch {torch.__version__} lacks torch._C._will_engine_execute_node, so splitgrad cannot tell which "
            "weight gradients this backward owes; use immediate mode (delay_wgrad_compute=False, "
            "fuse_wgrad_accumulation=False)"
        )
    key = id(param) if key is None else key
    node = None if cache is None else cache.get(key)
    if node is not None and getattr(node, "variable", None) is not param:
        node = None  # the slot belongs to another tensor now
    route = _ask(will_execute, node) if node is not None else WgradRoute.SKIP
    if route is WgradRoute.SKIP:
        node = torch.autograd.graph.get_gradient_edge(param).node
        route = _ask(will_execute, node)
        if cache is not None and getattr(node, "variable", None) is param:
            cache[key] = node
    return route


def _ask(will_execute: Callable[[Any], bool], node: Any) -> WgradRoute:
    try:
        return WgradRoute.ACCUMULATE if will_execute(node) else WgradRoute.SKIP
    except RuntimeError as err:
        # The engine refuses exactly one case for a leaf in the graph: autograd.grad capturing it.
        if "autograd.grad" in str(err):
            return WgradRoute.RETURN
        raise


def split_backward(backward: Callable[..., Any]) -> Callable[..., Any]:
    """``once_differentiable`` for the backward of a split layer's autograd Function.

    Records ``ctx.create_graph`` (whether this backward builds a graph, i.e. ``create_graph=True``) before
    ``once_differentiable`` switches grad mode off, so the routing can refuse to park work that plain
    autograd would have written with a graph.
    """
    inner = once_differentiable(backward)

    @functools.wraps(backward)
    def wrapper(ctx: Any, *grads: Any) -> Any:
        ctx.create_graph = torch.is_grad_enabled()
        return inner(ctx, *grads)

    return wrapper
