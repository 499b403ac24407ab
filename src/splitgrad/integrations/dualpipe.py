"""DeepSeek's DualPipe with splitgrad layers: their weight-gradient work goes through DualPipe's ``WeightGradStore``.

DualPipe (``pip install dualpipe``; DeepSeek's bidirectional pipeline, ``dualpipe.DualPipe``) decides per
backward whether the weight gradient waits: around a backward it sets the class-level
``dualpipe.WeightGradStore.enabled``. While it is set, the layers are expected to compute only the input
gradient and ``WeightGradStore.put`` a closure that writes the weight gradient; DualPipe then ``flush``\\ es
that backward's closures as one entry and ``pop``\\ s (runs) the entries first in, first out at its W steps.
While it is not set, the layers write the weight gradient within the backward.

:func:`attach` makes splitgrad layers do exactly that, through the public
:attr:`~splitgrad.core.WeightGradStore.on_queued` listener of each layer's store. The layers must be built with
``delay_wgrad_compute=True``; each task a backward queues is, at once,

* put into DualPipe's store (``WeightGradStore.put(task.run)``) while DualPipe's store is enabled: it runs
  when DualPipe pops that backward's entry. Until then it stays queued in the layer's own store, so splitgrad
  still counts it (``splitgrad.pending_wgrad``, ``guard_optimizer``, ``ensure_no_pending_wgrad``); a task runs
  once, so if something else ran it first (``backward_dw``), DualPipe's later call raises instead of writing
  the gradient twice, and one DualPipe dropped (``WeightGradStore.clear()`` after a failed step) stays owed
  in splitgrad's account rather than lost;
* run right away otherwise (DualPipe's full backward).

The dualpipe package is imported when :func:`attach` is called (``pip install 'splitgrad[dualpipe]'``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn
from torch.utils.hooks import RemovableHandle

from ..core import WeightGradStore, WgradTask, split_modules

__all__ = ["DualPipeBridge", "attach"]


class DualPipeBridge:
    """What :func:`attach` installed: one listener per layer store; :meth:`remove` (or leaving a ``with``
    block) takes them off again."""

    def __init__(self, handles: list[RemovableHandle]) -> None:
        self._handles = handles

    def remove(self) -> None:
        """Detach: tasks queued from now on wait for ``backward_dw`` again."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def __enter__(self) -> DualPipeBridge:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def attach(model: nn.Module) -> DualPipeBridge:
    """Route the deferred weight-gradient work of ``model``'s splitgrad layers through DualPipe's store.

    Args:
        model: a DualPipe stage, or the pair of modules given to ``DualPipe`` (any module holding splitgrad
            layers).

    Returns:
        The bridge (``remove()`` it, or use it as a context manager).

    Raises:
        ValueError: ``model`` holds no splitgrad layer, one of them does not delay its weight gradient
            (DualPipe must be able to defer every one), or a layer's store already has a queue listener
            (attached twice: each task would be handed over twice).
    """
    from dualpipe import WeightGradStore as DualPipeStore

    layers = list(split_modules(model))
    if not layers:
        raise ValueError(f"dualpipe.attach: {type(model).__name__} contains no splitgrad layer")
    immediate = [name for name, m in layers if not m.need_backward_dw()]
    if immediate:
        raise ValueError(
            f"dualpipe.attach: splitgrad layers {immediate} were built without delay_wgrad_compute=True; DualPipe "
            "decides per backward whether the weight gradient waits, so every layer must be able to defer it"
        )
    # One listener per store: a composite op exposes its inner op's store as its own.
    stores: dict[int, WeightGradStore] = {id(m.wgrad_store): m.wgrad_store for _, m in layers}
    taken = [s.name for s in stores.values() if len(s.on_queued)]
    if taken:
        raise ValueError(
            f"dualpipe.attach: the stores of {taken} already have a queue listener (attached twice?)"
        )
    listener = _listener(DualPipeStore)
    return DualPipeBridge([store.on_queued.register(listener) for store in stores.values()])


def _listener(dualpipe_store: Any) -> Callable[[WgradTask], None]:
    def on_queued(task: WgradTask) -> None:
        if dualpipe_store.enabled:
            dualpipe_store.put(task.run)  # runs when DualPipe pops this backward's entry
        else:
            task.run()  # DualPipe's full backward: the weight gradient now

    return on_queued
