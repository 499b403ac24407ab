"""Where captured graphs write parameter gradients, and the Python side effects a replay must redo.

A graph replays kernels on fixed memory. Three things that eager splitgrad does in Python therefore need
explicit handling around a replay:

* **the gradient buffer**: eager code assigns ``param.grad = dw`` on the first write; a graph can only add into
  memory that existed at capture. :class:`GradTarget` keeps that static buffer: before a replay it re-binds it
  (zeroed) when ``param.grad`` is ``None`` — which gives exactly eager's "first write assigns" result — and
  refuses when ``param.grad`` (or ``main_grad``) was rebound to another tensor, which the graph would not see.
* **``grad_added_to_main_grad``**: set to ``True`` again after each replay, for the parameters whose capture set it.
* **wgrad hooks**: never part of a graph. During warm-up and capture every owner's hook list is swapped for a
  :class:`_MutedHooks` that records the fires instead of running the hooks; replay fires the recorded owners
  explicitly, once per recorded fire, in the recorded order.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Iterator

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ..core import WeightGradStore, WgradHooks

__all__ = ["GradTarget", "ParamStateSnapshot", "muted_hooks"]

logger = logging.getLogger(__name__)


class _MutedHooks:
    """Takes a store's ``hooks`` place during capture: records each ``fire()`` and runs nothing."""

    def __init__(self, original: WgradHooks, store: WeightGradStore, log: list[WeightGradStore]) -> None:
        self._original = original
        self._store = store
        self._log = log

    def register(self, hook: Callable[[], None]) -> RemovableHandle:
        return self._original.register(hook)

    def fire(self) -> None:
        self._log.append(self._store)

    def __len__(self) -> int:
        return len(self._original)


@contextlib.contextmanager
def muted_hooks(stores: Iterable[WeightGradStore]) -> Iterator[list[WeightGradStore]]:
    """Within the block, hooks of ``stores`` do not run; yields the list of stores whose hooks were fired."""
    log: list[WeightGradStore] = []
    swapped: list[tuple[WeightGradStore, WgradHooks]] = []
    try:
        for store in stores:
            original = store.hooks
            store.hooks = _MutedHooks(original, store, log)  # type: ignore[assignment]
            swapped.append((store, original))
        yield log
    finally:
        for store, original in reversed(swapped):
            store.hooks = original


class GradTarget:
    """One parameter gradient a graph writes itself (not through autograd), with its static buffers.

    Args:
        param: the parameter.
        name: its qualified name (for errors).
        grad: the ``.grad`` buffer the graph adds into, or ``None`` if the graph does not write ``.grad``.
        main_grad: the ``main_grad`` buffer the graph may add into, or ``None``.
        sets_added_flag: the capture set ``param.grad_added_to_main_grad = True``; replays set it again.
    """

    __slots__ = ("grad", "main_grad", "name", "overwrite_main_grad", "param", "sets_added_flag")

    def __init__(
        self,
        param: nn.Parameter,
        name: str,
        *,
        grad: torch.Tensor | None,
        main_grad: torch.Tensor | None,
        sets_added_flag: bool,
    ) -> None:
        self.param = param
        self.name = name
        self.grad = grad
        self.main_grad = main_grad
        self.overwrite_main_grad = bool(getattr(param, "overwrite_main_grad", False))
        self.sets_added_flag = sets_added_flag

    def prepare(self, where: str) -> None:
        """Before a replay: make sure the graph's buffers are the ones the parameter exposes."""
        if self.grad is not None:
            current = self.param.grad
            if current is None:
                with torch.no_grad():
                    self.grad.zero_()
                self.param.grad = self.grad
            elif current is not self.grad:
                raise RuntimeError(
                    f"{where}: `{self.name}.grad` was replaced by another tensor after capture; the graph "
                    "accumulates into the buffer that was `.grad` at capture. Zero gradients in place "
                    "(optimizer.zero_grad(set_to_none=False)) or set them to None, never assign a new tensor."
                )
        if self.main_grad is not None:
            if getattr(self.param, "main_grad", None) is not self.main_grad:
                raise RuntimeError(
                    f"{where}: `{self.name}.main_grad` was replaced after capture; the graph adds into the "
                    "captured buffer. Re-capture after changing main_grad buffers."
                )
            overwrite = bool(getattr(self.param, "overwrite_main_grad", False))
            if overwrite != self.overwrite_main_grad:
                raise RuntimeError(
                    f"{where}: `{self.name}.overwrite_main_grad` changed after capture "
                    f"({self.overwrite_main_grad} -> {overwrite}); the captured kernel keeps the old behaviour. "
                    "Re-capture."
                )

    def finish(self) -> None:
        """After a replay: redo the attribute write the capture did in Python."""
        if self.sets_added_flag:
            self.param.grad_added_to_main_grad = True

    def __repr__(self) -> str:
        return (
            f"GradTarget({self.name!r}, grad={self.grad is not None}, main_grad={self.main_grad is not None})"
        )


class ParamStateSnapshot:
    """The gradient state of some parameters, restored after warm-up and capture have scribbled on it.

    Records ``.grad`` (object and values), ``main_grad`` (values) and ``grad_added_to_main_grad``. Restoring
    writes values back into the same tensors, so the identity of every buffer a graph captured is kept.
    """

    def __init__(self, params: Iterable[nn.Parameter]) -> None:
        self._entries = []
        seen: set[int] = set()
        for p in params:
            if id(p) in seen:
                continue
            seen.add(id(p))
            grad = p.grad
            main_grad = getattr(p, "main_grad", None)
            self._entries.append(
                (
                    p,
                    grad,
                    None if grad is None else grad.detach().clone(),
                    main_grad,
                    None if main_grad is None else main_grad.detach().clone(),
                    getattr(p, "grad_added_to_main_grad", _MISSING),
                )
            )

    def original_grad(self, param: nn.Parameter) -> torch.Tensor | None:
        for p, grad, *_ in self._entries:
            if p is param:
                return grad
        raise KeyError("parameter not in snapshot")

    def restore(self) -> None:
        with torch.no_grad():
            for p, grad, grad_values, main_grad, main_values, added in self._entries:
                if grad is not None:
                    grad.copy_(grad_values)
                p.grad = grad
                if main_grad is not None:
                    main_grad.copy_(main_values)
                if added is not _MISSING:
                    p.grad_added_to_main_grad = added


_MISSING = object()
