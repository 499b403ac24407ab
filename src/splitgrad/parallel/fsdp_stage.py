"""A ``fully_shard``-ed pipeline stage for splitgrad's pipeline runtime, reducing at its last W.

The runtime (:mod:`splitgrad.pipeline.runtime`) treats a stage module with ``no_sync()`` and
``finish_grad_sync()`` as data parallel: it runs the stage's actions inside ``no_sync()`` until the
schedule's ``R`` point (just before the stage's last B), and calls ``finish_grad_sync()`` at ``RF``. For FSDP2
``no_sync()`` is ``set_requires_gradient_sync(False)``; with :func:`~splitgrad.parallel.defer_fsdp_reduction`
installed, FSDP2 reduce-scatters the stage's autograd-written gradients at its last B and splitgrad's hooks
reduce-scatter the deferred ones inside the stage's last W, once no W work of the stage is owed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch import nn

from .fsdp import defer_fsdp_reduction

__all__ = ["FSDPStage"]


class FSDPStage(nn.Module):
    """Wrap a ``fully_shard``-ed stage so the pipeline runtime drives its gradient sync.

    Args:
        module: the stage, already ``fully_shard``-ed over the data-parallel mesh (the root call included).

    Raises:
        ValueError: ``module`` is not ``fully_shard``-ed (from :func:`defer_fsdp_reduction`).
    """

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module
        self.reduction = defer_fsdp_reduction(module)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradient sync off for the block (FSDP2's ``set_requires_gradient_sync(False)``), then on again."""
        self.module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.module.set_requires_gradient_sync(True)

    def finish_grad_sync(self) -> None:
        """Check every deferred gradient was reduce-scattered (FSDP2 reductions are synchronous on return).

        Raises:
            RuntimeError: deferred gradients are still held (a W of this stage did not run), naming the count.
        """
        held = self.reduction.held_gradients
        if held:
            raise RuntimeError(
                f"FSDPStage({type(self.module).__name__}): {held} deferred gradients were never reduce-scattered "
                "(weight-gradient work of this stage is still owed); run every W of the step first"
            )
