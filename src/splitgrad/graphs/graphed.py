"""``GraphedCallable``: one captured (callable, microbatch) — forward, backward and wgrad graphs — as a callable.

Calling it replays the forward graph inside an autograd Function whose backward replays the backward graph;
:meth:`GraphedCallable.backward_dw` replays the wgrad graph and then fires the wgrad hooks, which no graph can
contain. Between replays it checks what a graph cannot see: a stale forward, a pending wgrad that a second
backward would overwrite, gradient buffers rebound after capture, switches flipped after capture.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from ..core import WeightGradStore
from ..core.store import WgradClaim
from .backend import Graph
from .targets import GradTarget

__all__ = ["CapturedGraphs", "GraphedCallable"]

logger = logging.getLogger(__name__)


@dataclass(kw_only=True, slots=True)
class CapturedGraphs:
    """Everything one capture produced; the static tensors are the graphs' fixed memory."""

    forward: Graph
    """Forward graph: reads ``static_inputs`` (and parameters), writes ``static_outputs``."""
    backward: Graph | None
    """Backward graph (input grads + every non-deferred weight grad); None when no output requires grad."""
    wgrad: Graph | None
    """Deferred weight-gradient graph; None when no captured layer defers."""
    static_inputs: tuple[torch.Tensor, ...]
    """Inputs copied in before each forward replay."""
    static_outputs: tuple[torch.Tensor, ...]
    """Outputs the forward graph rewrites on each replay (detached)."""
    output_requires_grad: tuple[bool, ...]
    """Which outputs were differentiable at capture."""
    output_kind: type | None
    """``None``: the callable returned one tensor; else ``tuple``/``list`` of tensors."""
    static_grad_outputs: tuple[torch.Tensor | None, ...]
    """Output gradients copied in before each backward replay (None for outputs without grad)."""
    grad_returns: tuple[torch.Tensor | None, ...]
    """What the autograd backward returns for (inputs..., params...); held so autograd cannot steal them."""
    forward_hooks: tuple[WeightGradStore, ...]
    """Owners whose wgrad hooks fired while the forward was captured (normally none)."""
    backward_hooks: tuple[WeightGradStore, ...]
    """Owners whose hooks fired during backward capture (fused, non-deferred wgrad), in order."""
    wgrad_hooks: tuple[WeightGradStore, ...]
    """Owner of each deferred task of the wgrad graph, in task order."""
    backward_targets: tuple[GradTarget, ...]
    wgrad_targets: tuple[GradTarget, ...]
    dw_params: tuple[nn.Parameter, ...]
    """Parameters the wgrad graph writes (``get_backward_dw_params``)."""
    delay_flags: tuple[tuple[WeightGradStore, bool], ...]
    """Each owner's ``delay_wgrad_compute`` at capture; a change makes the graphs wrong."""


class _GraphedFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, runner: GraphedCallable, *inputs: torch.Tensor):  # type: ignore[override]
        outputs = runner._replay_forward(inputs[: runner._num_inputs])
        ctx.runner = runner
        ctx.generation = runner._forward_generation
        detached = tuple(o.detach() for o in outputs)
        differentiable = runner._captured.output_requires_grad
        ctx.mark_non_differentiable(*(d for d, diff in zip(detached, differentiable) if not diff))
        return detached

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads: torch.Tensor):  # type: ignore[override]
        runner: GraphedCallable = ctx.runner
        runner._replay_backward(grads, ctx.generation)
        return (None, *runner._captured.grad_returns)


class GraphedCallable:
    """A callable replaying captured graphs, with TE's split-backward API (``backward_dw`` and friends).

    Made by :func:`~splitgrad.graphs.make_graphed_callables`; not an ``nn.Module`` on purpose: the parameters
    stay owned by ``module`` (give those to the optimizer), and whole-model helpers such as
    ``splitgrad.backward_dw(model)`` cannot mistake the graph-owned wgrad for queued work.

    Semantics (see ``docs/graphs.md``): outputs are the static output buffers (consume them before the next
    call); gradients accumulate like eager, with the deferred/fused ones written into buffers fixed at capture.
    """

    def __init__(
        self,
        fn: object,
        captured: CapturedGraphs,
        *,
        label: str,
        stage: int,
        microbatch: int,
        params: Sequence[nn.Parameter],
    ) -> None:
        self.module = fn
        self.label = label
        self.stage = stage
        self.microbatch = microbatch
        self._captured = captured
        self._params = tuple(params)
        self._param_ptrs = tuple(p.data_ptr() for p in self._params)
        self._num_inputs = len(captured.static_inputs)
        self._training = fn.training if isinstance(fn, nn.Module) else None
        self._forward_generation = 0
        self._claims: list[WgradClaim] = []
        self._pending_dw = False

    # -- public API ---------------------------------------------------------------------------------------
    @property
    def static_inputs(self) -> tuple[torch.Tensor, ...]:
        """The graph's input buffers; passing them to the call skips the copy."""
        return self._captured.static_inputs

    @property
    def static_outputs(self) -> tuple[torch.Tensor, ...]:
        """The graph's output buffers (what calls return, detached); rewritten by every call."""
        return self._captured.static_outputs

    @property
    def graphs(self) -> dict[str, Graph | None]:
        """The captured graphs by role: ``forward``, ``backward``, ``wgrad``."""
        c = self._captured
        return {"forward": c.forward, "backward": c.backward, "wgrad": c.wgrad}

    def need_backward_dw(self) -> bool:
        """True when some captured layer defers its weight gradient (there is a wgrad graph)."""
        return self._captured.wgrad is not None

    @property
    def pending_wgrad(self) -> int:
        """Owed work units of the wgrad graph awaiting its replay: one per deferring owner (the count
        ``splitgrad.pending_wgrad(model)`` includes as ``in_graphs``), 0 once replayed."""
        return len(self._claims)

    def get_backward_dw_params(self) -> list[nn.Parameter]:
        """Exactly the parameters :meth:`backward_dw` writes, in module order."""
        return list(self._captured.dw_params)

    def __call__(self, *args: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...] | list[torch.Tensor]:
        """Replay the forward graph on ``args`` (same shapes, dtypes and devices as the sample args)."""
        self._check_call(args)
        outputs = _GraphedFunction.apply(self, *args, *self._params)
        kind = self._captured.output_kind
        return outputs[0] if kind is None else kind(outputs)

    def backward_dw(self) -> None:
        """Replay the wgrad graph of the last backward, then fire each captured owner's wgrad hooks.

        Raises:
            RuntimeError: nothing is deferred, or no backward is waiting for its wgrad.
        """
        c = self._captured
        if c.wgrad is None:
            raise RuntimeError(
                f"{self.label}.backward_dw(): no captured layer defers its weight gradient "
                "(delay_wgrad_compute was off for all of them at capture), so there is no wgrad graph"
            )
        if not self._pending_dw:
            raise RuntimeError(
                f"{self.label}.backward_dw(): no pending weight-gradient work (call it once after each backward)"
            )
        self._check_delay_flags()
        where = f"{self.label}.backward_dw()"
        for target in c.wgrad_targets:
            target.prepare(where)
        with torch.profiler.record_function(f"splitgrad.graphs.wgrad:{self.label}"):
            c.wgrad.replay()
        self._settle_owed()
        for target in c.wgrad_targets:
            target.finish()
        for store in c.wgrad_hooks:
            store.hooks.fire()

    # -- replay internals ---------------------------------------------------------------------------------
    def _check_call(self, args: Sequence[object]) -> None:
        statics = self._captured.static_inputs
        if len(args) != len(statics):
            raise ValueError(f"{self.label}: expected {len(statics)} tensor argument(s), got {len(args)}")
        for i, (arg, static) in enumerate(zip(args, statics)):
            if not isinstance(arg, torch.Tensor):
                raise ValueError(f"{self.label}: argument {i} must be a tensor, got {type(arg).__name__}")
            if arg.shape != static.shape or arg.dtype != static.dtype or arg.device != static.device:
                raise ValueError(
                    f"{self.label}: argument {i} is {tuple(arg.shape)} {arg.dtype} on {arg.device}, but the graph "
                    f"was captured for {tuple(static.shape)} {static.dtype} on {static.device}"
                )
            if arg.requires_grad and not static.requires_grad and torch.is_grad_enabled():
                raise ValueError(
                    f"{self.label}: argument {i} requires grad but its sample arg did not, so the graph "
                    "computes no gradient for it; capture with a sample that requires grad"
                )
        if self._training is not None and self.module.training != self._training:
            raise RuntimeError(
                f"{self.label}: captured with training={self._training}, called with "
                f"training={self.module.training}; call the module itself in the other mode, or re-capture"
            )
        for p, ptr in zip(self._params, self._param_ptrs):
            if not p.requires_grad or p.data_ptr() != ptr:
                raise RuntimeError(
                    f"{self.label}: a parameter of shape {tuple(p.shape)} was frozen, re-allocated or moved "
                    "after capture (requires_grad / .data / .to()); the graphs use the captured memory and "
                    "gradient set. Re-capture."
                )

    def _check_delay_flags(self) -> None:
        for store, delay in self._captured.delay_flags:
            if store.delay_wgrad_compute() != delay:
                raise RuntimeError(
                    f"{self.label}: delay_wgrad_compute of {store.name} changed after capture ({delay} -> "
                    f"{not delay}); the graphs keep the captured split. Re-capture."
                )

    def _replay_forward(self, args: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        c = self._captured
        if self._pending_dw:
            raise RuntimeError(
                f"{self.label}: forward called while the wgrad of the previous backward is pending; the replay "
                "would overwrite the activations the wgrad graph reads. Call backward_dw() first, or capture one "
                "graph per in-flight microbatch (make_graphed_callables(..., order=...))."
            )
        self._check_delay_flags()
        with torch.no_grad():
            for arg, static in zip(args, c.static_inputs):
                if arg.data_ptr() != static.data_ptr():
                    static.copy_(arg)
        c.forward.replay()
        self._forward_generation += 1
        for store in c.forward_hooks:
            store.hooks.fire()
        return c.static_outputs

    def _replay_backward(self, grads: Sequence[torch.Tensor | None], generation: int) -> None:
        c = self._captured
        if generation != self._forward_generation:
            raise RuntimeError(
                f"{self.label}: backward of an older forward call; the forward was replayed again since "
                f"(call {generation} vs {self._forward_generation}) and overwrote the activations. Run backward "
                "before calling the graphed callable again, or capture one graph per microbatch (order=...)."
            )
        if self._pending_dw:
            raise RuntimeError(
                f"{self.label}: second backward while the wgrad of the previous one is pending; replaying would "
                "overwrite what the wgrad graph reads. Call backward_dw() in between."
            )
        if c.backward is None:
            raise RuntimeError(
                f"{self.label}: no output required grad at capture, there is no backward graph"
            )
        where = f"{self.label} backward"
        for target in c.backward_targets:
            target.prepare(where)
        with torch.no_grad():
            for grad, static in zip(grads, c.static_grad_outputs):
                if static is not None and grad is not None and grad.data_ptr() != static.data_ptr():
                    static.copy_(grad)
        c.backward.replay()
        for target in c.backward_targets:
            target.finish()
        for store in c.backward_hooks:
            store.hooks.fire()
        if c.wgrad is not None:
            # Visible to splitgrad.ensure_no_pending_wgrad / guard_optimizer until backward_dw() replays it:
            # one claim per owner, each settled exactly once (by the replay, or when this object is collected).
            self._claims = [store.owe() for store in c.wgrad_hooks]
            self._pending_dw = True

    def _settle_owed(self) -> None:
        claims, self._claims = self._claims, []
        for claim in claims:
            claim.settle()
        self._pending_dw = False

    def __del__(self) -> None:
        if getattr(self, "_pending_dw", False):
            warnings.warn(
                f"{self.label} was garbage collected with a pending wgrad replay: that weight gradient is lost "
                "(call backward_dw() after each backward)",
                RuntimeWarning,
                stacklevel=1,
            )
            # Nothing can replay it any more: stop counting it (the warning is the loud part).
            self._settle_owed()

    def __repr__(self) -> str:
        return (
            f"GraphedCallable({self.label!r}, stage={self.stage}, microbatch={self.microbatch}, "
            f"wgrad_graph={self.need_backward_dw()}, pending_wgrad={self.pending_wgrad})"
        )
