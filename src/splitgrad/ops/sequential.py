"""``ops.Sequential``: a drop-in ``nn.Sequential`` that runs consecutive fusible ops as one autograd Function.

It owns no :class:`~splitgrad.core.WeightGradStore` itself: its deferred-wgrad API delegates to the
split-capable modules inside it (ops such as ``BasicLinear``/``GroupedLinear``/``Linear``, or any splitgrad
module passed through), so :func:`splitgrad.backward_dw` on a model containing it counts every task once.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ..core import split_modules
from .fused import default_fusions
from .fuser import FusionRegistry, OperationFuser
from .op import FusibleOperation

__all__ = ["Sequential", "WgradHookHandles"]

logger = logging.getLogger(__name__)


class WgradHookHandles:
    """One handle for a hook registered on several ops; ``remove()`` removes it from all of them."""

    def __init__(self, handles: list[RemovableHandle]) -> None:
        self.handles = handles

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()

    def __len__(self) -> int:
        return len(self.handles)

    def __enter__(self) -> WgradHookHandles:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


class Sequential(nn.Sequential):
    """``nn.Sequential`` whose runs of consecutive :class:`~splitgrad.ops.op.FusibleOperation`\\ s are fused.

    Indexing, slicing, ``len``, ``append``/``insert``/``del`` and ``state_dict`` behave as in
    ``nn.Sequential``; modules that are not fusible ops are called as usual between the fused runs.

    Args:
        *args: modules in order (or one ``OrderedDict`` of them, as ``nn.Sequential``).
        fusions: the fusion functions to apply (default: a fresh :func:`~splitgrad.ops.default_fusions`
            registry, reachable as ``seq.fusions``; ``FusionRegistry()`` runs every op unfused).

    Call as ``seq(x, *extra_inputs)`` with ``x: (..., features)``; ``extra_inputs`` are the ops' extra inputs
    in order (e.g. one ``split_sizes`` per ``GroupedLinear``).
    """

    def __init__(
        self, *args: nn.Module | OrderedDict[str, nn.Module], fusions: FusionRegistry | None = None
    ) -> None:
        super().__init__(*args)
        self.fusions = default_fusions() if fusions is None else fusions
        self._cached_modules: tuple[nn.Module, ...] = ()
        self._cached_steps: list[OperationFuser | nn.Module] = []

    def __getitem__(self, idx: int | slice) -> Any:
        if isinstance(idx, slice):
            return type(self)(OrderedDict(list(self._modules.items())[idx]), fusions=self.fusions)
        return super().__getitem__(idx)

    def _steps(self) -> list[OperationFuser | nn.Module]:
        modules = tuple(self._modules.values())
        cached = self._cached_modules
        # Identity, not ids: a freed module's id may be reused by its replacement.
        if len(modules) != len(cached) or any(a is not b for a, b in zip(modules, cached)):
            steps: list[OperationFuser | nn.Module] = []
            run: list[FusibleOperation] = []
            for module in modules:
                if isinstance(module, FusibleOperation):
                    run.append(module)
                    continue
                if run:
                    steps.append(OperationFuser(run, self.fusions))
                    run = []
                steps.append(module)
            if run:
                steps.append(OperationFuser(run, self.fusions))
            self._cached_modules, self._cached_steps = modules, steps
            logger.debug(
                "ops.Sequential regrouped: %d fused run(s) in %d step(s)", len(self.fusers), len(steps)
            )
        return self._cached_steps

    @property
    def fusers(self) -> list[OperationFuser]:
        """The fusers of the current runs of ops (for inspecting ``forward_ops`` / ``backward_ops``)."""
        return [s for s in self._steps() if isinstance(s, OperationFuser)]

    def forward(self, x: torch.Tensor, *extra_inputs: Any) -> torch.Tensor:  # type: ignore[override]
        """``x: (..., features)`` through every module; ``extra_inputs`` go to the ops that take them."""
        steps = self._steps()
        wanted = sum(s.num_extra_inputs for s in steps if isinstance(s, OperationFuser))
        if wanted != len(extra_inputs):
            raise ValueError(
                f"ops.Sequential: its ops take {wanted} extra input(s) (one split_sizes per GroupedLinear), "
                f"got {len(extra_inputs)}"
            )
        pos = 0
        for step in steps:
            if isinstance(step, OperationFuser):
                n = step.num_extra_inputs
                x = step(x, extra_inputs[pos : pos + n])
                pos += n
            else:
                x = step(x)
        return x

    # -- the split-backward API, delegated to the split-capable modules inside --------------------------
    def _split_members(self) -> list[nn.Module]:
        return [m for _, m in split_modules(self) if m is not self]

    def need_backward_dw(self) -> bool:
        """True when any op inside defers its weight gradient."""
        return any(m.wgrad_store.delay_wgrad_compute() for m in self._split_members())

    def backward_dw(self) -> None:
        """Run one pending wgrad task on each op that has one (last op first, i.e. backprop order).

        Raises:
            RuntimeError: when no op has pending work (as a module's ``backward_dw`` does).
        """
        members = self._split_members()
        pending = [m for m in reversed(members) if len(m.wgrad_store)]
        if not pending:
            captured = sum(m.wgrad_store.captured for m in members)
            hint = f"; {captured} task(s) sit in capture_wgrad bundles (run those)" if captured else ""
            raise RuntimeError(
                f"ops.Sequential.backward_dw(): no op has pending weight-gradient work "
                f"(need_backward_dw={self.need_backward_dw()}, split ops={len(members)}){hint}"
            )
        for m in pending:
            m.wgrad_store.run_next()

    def get_backward_dw_params(self) -> list[nn.Parameter]:
        """Every deferred trainable parameter of the ops inside, in module order."""
        return [p for m in self._split_members() for p in m.get_backward_dw_params()]

    def register_wgrad_accumulation_and_reduce_hooks(self, hook: Callable[[], None]) -> WgradHookHandles:
        """Register ``hook`` on every split-capable op inside (those present now).

        It fires **once per op**, right after that op's gradients are written (in :meth:`backward_dw`, or in
        backward for ``accumulate_into_main_grad`` without delay) — the modules' contract, which is what a
        data-parallel wrapper needs to reduce each op's gradients as soon as they are ready. It is not fired
        once per ``Sequential.backward_dw``.

        Returns:
            A handle whose ``remove()`` removes the hook from all of them.
        """
        return WgradHookHandles(
            [m.register_wgrad_accumulation_and_reduce_hooks(hook) for m in self._split_members()]
        )

    def set_delay_wgrad_compute(self, enabled: bool) -> None:
        """Switch deferral on every split-capable op inside; pending tasks stay pending."""
        for m in self._split_members():
            m.set_delay_wgrad_compute(enabled)
