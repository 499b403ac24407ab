"""A ``fully_shard``-ed pipeline stage for splitgrad's pipeline runtime: its reduce-scatter is the ``RF`` action.

The runtime (:mod:`splitgrad.pipeline`) treats a stage module with ``no_sync()`` and
``finish_grad_sync()`` as data parallel: it runs the stage's actions inside ``no_sync()`` until the
schedule's ``R`` point (just before the stage's last B), and calls ``finish_grad_sync()`` at ``RF``. For FSDP2
``no_sync()`` is ``set_requires_gradient_sync(False)``; FSDP2 reduce-scatters the stage's autograd-written
gradients at its last B. The deferred ones (:func:`~splitgrad.parallel.defer_fsdp_reduction`) are marked ready
by the wgrad hooks at each group's last W and reduce-scattered by the ``RF`` action (``reduction="finish"``), or
started in the background at that last W and joined by ``RF`` (``reduction="async"``); either way the
runtime's measured timeline shows each reduce-scatter as a ``grad-sync`` event of the stage
(:meth:`FSDPStage.pop_comm_events`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Literal

from torch import nn

from .reduction import defer_fsdp_reduction

__all__ = ["FSDPStage"]


class FSDPStage(nn.Module):
    """Wrap a ``fully_shard``-ed stage so the pipeline runtime drives its gradient sync.

    Args:
        module: the stage, already ``fully_shard``-ed over the data-parallel mesh (the root call included).
        reduction: ``"finish"``: the deferred reduce-scatters run in the ``RF`` action; ``"async"``: each starts
            on a background thread at its group's last W, overlapping the rest of the step, and ``RF`` joins
            them (collective: every rank of the data-parallel mesh constructs its stage the same way).
        timeout: seconds ``RF`` waits for each background reduce-scatter.

    Raises:
        ValueError: ``module`` is not ``fully_shard``-ed (from :func:`defer_fsdp_reduction`), or ``reduction``
            is neither mode.
    """

    def __init__(
        self, module: nn.Module, *, reduction: Literal["finish", "async"] = "finish", timeout: float = 300.0
    ) -> None:
        super().__init__()
        if reduction not in ("finish", "async"):
            raise ValueError(f"FSDPStage: reduction must be 'finish' or 'async', got {reduction=}")
        self.module = module
        self.reduction = defer_fsdp_reduction(module, mode=reduction, timeout=timeout)

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
        """The ``RF`` action: reduce-scatter the deferred gradients (or join their background reductions).

        Raises:
            RuntimeError: deferred gradients are still held (a W of this stage did not run), naming the count;
                a background reduction failed or timed out.
        """
        self.reduction.finish()
        held = self.reduction.held_gradients
        if held:
            raise RuntimeError(
                f"FSDPStage({type(self.module).__name__}): {held} deferred gradients were never reduce-scattered "
                "(weight-gradient work of this stage is still owed); run every W of the step first"
            )

    def pop_comm_events(self) -> list[tuple[str, float, float]]:
        """The reduce-scatters since the last call, ``(label, start, end)`` in ``time.perf_counter()`` seconds."""
        return self.reduction.pop_comm_events()
