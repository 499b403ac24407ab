"""A forward as *steps*: a generator that runs until it has started a communication, then yields.

A module that communicates in its forward (an expert-parallel MoE layer's dispatch and combine all-to-alls) can
offer ``forward_steps(*args)``: a generator that runs the forward up to the point where its next exchange is
*issued* (asynchronously), yields, and on resumption waits for it and goes on; its ``return`` value is the
forward's output. Its ``forward`` drives that same generator to completion (:func:`run_steps`), so there is one
code path for the layer's logic. A caller that owns the thread (the single-thread overlapped forward/backward
driver of :mod:`splitgrad.parallel.expert`) advances it one step at a time and runs other work while each
exchange is in flight.

Containers (a transformer block, a model, a pipeline stage, a data-parallel wrapper) offer ``forward_steps`` too:
they walk into children that have steps (:func:`child_steps`) and call the others whole. A child with forward
hooks or pre-hooks registered is called whole as well, so its hooks fire exactly as in a plain forward (it then
simply yields nothing). A container's ``forward_steps`` is a twin of its plain ``forward`` (which calls its
children through ``__call__``, as before) rather than driving it: a generator in every plain forward would cost
``torch.compile`` its single graph of a dense model. The twins share their non-trivial parts as helper methods,
and the overlap tests compare the two paths bitwise.
"""

from __future__ import annotations

import logging
from collections.abc import Generator
from typing import Any

from torch import nn

__all__ = ["Steps", "child_steps", "has_steps", "run_steps"]

logger = logging.getLogger(__name__)

#: What ``forward_steps`` returns: yields at each started exchange, returns the forward's output.
Steps = Generator[object, None, Any]


def has_steps(module: nn.Module) -> bool:
    """Whether ``module``'s forward can be walked in steps: it has a callable ``forward_steps`` and no forward
    hook or pre-hook (walking in would skip them)."""
    if not callable(getattr(module, "forward_steps", None)):
        return False
    return not (module._forward_hooks or module._forward_pre_hooks)


def child_steps(module: nn.Module, *args: Any, **kwargs: Any) -> Steps:
    """``module(*args, **kwargs)`` as steps: its own ``forward_steps`` when :func:`has_steps`, else one call.

    Use as ``y = yield from child_steps(self.mlp, x)`` inside a container's ``forward_steps``.
    """
    if has_steps(module):
        return (yield from module.forward_steps(*args, **kwargs))
    return module(*args, **kwargs)


def run_steps(steps: Steps) -> Any:
    """Drive ``steps`` to completion (what a plain ``forward`` does); returns its ``return`` value."""
    while True:
        try:
            next(steps)
        except StopIteration as stop:
            return stop.value
