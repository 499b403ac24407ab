"""Running a run of fusible ops as one autograd Function, and the fusion registry that rewrites it.

:class:`OperationFuser` flattens its ops into basic ops, asks a :class:`FusionRegistry` for a forward plan and a
backward plan (each a list of basic or fused ops covering the basic ops in order), and runs them inside one
``torch.autograd.Function``: the forward walks the forward plan, the backward walks the backward plan in
reverse and hands every returned parameter gradient to autograd.

A fusion is a pure function ``list[op] -> list[op]`` (``op`` = :class:`~splitgrad.ops.op.BasicOperation` or
:class:`~splitgrad.ops.op.FusedOperation`) that replaces some windows of consecutive ops by fused ops. The
fuser checks that a fusion kept every basic op, in order (a broken fusion is an error, never a silently
dropped layer). Fusions should decide on structure only (op types, sizes, dtypes): the plan is cached until the
registry changes.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from ..core import split_backward
from ..core.compile import apply_outside_compile
from .context import Fusible, OperationContext, PlanOp

__all__ = ["FusionFn", "FusionRegistry", "OperationFuser"]

logger = logging.getLogger(__name__)

# A basic op (``ops.op.BasicOperation``) or a fused op (``ops.op.FusedOperation``), seen structurally.
Op = PlanOp
#: A fusion: rewrites a list of ops (forward order) into an equivalent list with some windows fused.
FusionFn = Callable[[list[Op]], list[Op]]


class FusionRegistry:
    """Ordered forward and backward fusion functions, applied one after the other.

    Each :class:`~splitgrad.ops.Sequential` owns one (``seq.fusions``); :func:`~splitgrad.ops.default_fusions` builds the
    built-in set. An empty registry (``FusionRegistry()``) runs every op unfused.

    Args:
        forward: fusion functions for the forward pass, applied in order.
        backward: fusion functions for the backward pass, applied in order.
    """

    def __init__(self, forward: Iterable[FusionFn] = (), backward: Iterable[FusionFn] = ()) -> None:
        self._forward = list(forward)
        self._backward = list(backward)
        #: Bumped on every registration so fusers know their cached plan is stale.
        self.version = 0

    @property
    def forward(self) -> tuple[FusionFn, ...]:
        return tuple(self._forward)

    @property
    def backward(self) -> tuple[FusionFn, ...]:
        return tuple(self._backward)

    def register_forward(self, fn: FusionFn) -> FusionFn:
        """Append a forward fusion (usable as a decorator); returns ``fn``."""
        self._forward.append(_check_callable(fn))
        self.version += 1
        return fn

    def register_backward(self, fn: FusionFn) -> FusionFn:
        """Append a backward fusion (usable as a decorator); returns ``fn``."""
        self._backward.append(_check_callable(fn))
        self.version += 1
        return fn

    def __repr__(self) -> str:
        names = lambda fns: [getattr(f, "__name__", repr(f)) for f in fns]  # noqa: E731
        return f"FusionRegistry(forward={names(self._forward)}, backward={names(self._backward)})"


def _check_callable(fn: Any) -> FusionFn:
    if not callable(fn):
        raise TypeError(f"a fusion must be a callable list[op] -> list[op], got {type(fn).__name__}")
    return fn


@dataclasses.dataclass(kw_only=True, slots=True)
class _Layout:
    """A fuser's basic ops and where each one's extra inputs sit in a call's ``extra_inputs``."""

    #: The basic ops in forward order.
    ops: list[Fusible]
    #: ``(start, stop)`` into ``extra_inputs`` per basic op.
    extra_spans: list[tuple[int, int]]
    #: How many extra inputs a call takes in all.
    n_extra: int

    @classmethod
    def of(cls, ops: Iterable[Fusible]) -> _Layout:
        ops, spans, pos = list(ops), [], 0
        for op in ops:
            spans.append((pos, pos + op.num_extra_inputs))
            pos += op.num_extra_inputs
        return cls(ops=ops, extra_spans=spans, n_extra=pos)


class _Plan:
    """A fusion result: ops with the positions of the basic ops each one covers."""

    __slots__ = ("steps",)

    def __init__(self, steps: list[tuple[Op, range]]) -> None:
        self.steps = steps


def _make_plan(basic: list[Fusible], fusions: Sequence[FusionFn], kind: str) -> _Plan:
    ops: list[Op] = list(basic)
    for fn in fusions:
        ops = list(fn(list(ops)))
        strays = [type(op).__name__ for op in ops if not isinstance(op, PlanOp)]
        if strays:
            raise TypeError(f"{kind} fusion {getattr(fn, '__name__', fn)!r} returned non-ops: {strays}")
        flat = [b for op in ops for b in op.basic_ops()]
        if len(flat) != len(basic) or any(a is not b for a, b in zip(flat, basic)):
            raise RuntimeError(
                f"{kind} fusion {getattr(fn, '__name__', fn)!r} did not keep the basic ops in order: "
                f"got {[type(b).__name__ for b in flat]}, expected {[type(b).__name__ for b in basic]}"
            )
    steps, start = [], 0
    for op in ops:
        n = len(op.basic_ops())
        steps.append((op, range(start, start + n)))
        start += n
    return _Plan(steps)


class OperationFuser:
    """Runs consecutive fusible ops as one autograd Function, with the registry's fusions applied.

    Args:
        ops: the ops, in forward order (composite ops are expanded into their basic ops).
        fusions: the fusion functions to apply; None runs the ops unfused.

    Call as ``fuser(x, extra_inputs)`` with ``x: (..., features)`` and ``extra_inputs`` the ops' extra inputs
    in order (``GroupedLinear``'s split sizes).
    """

    def __init__(self, ops: Sequence[Fusible], fusions: FusionRegistry | None = None) -> None:
        self.ops = list(ops)
        self.fusions = FusionRegistry() if fusions is None else fusions
        self._plans: tuple[int, _Layout, _Plan, _Plan] | None = None

    @property
    def basic_ops(self) -> list[Fusible]:
        return list(self.plans()[0].ops)

    @property
    def num_extra_inputs(self) -> int:
        return self.plans()[0].n_extra

    def plans(self) -> tuple[_Layout, _Plan, _Plan]:
        """The basic-op layout and the (forward, backward) plans, recomputed when the registry changed."""
        if self._plans is None or self._plans[0] != self.fusions.version:
            layout = _Layout.of(b for op in self.ops for b in op.basic_ops())
            fwd = _make_plan(layout.ops, self.fusions.forward, "forward")
            bwd = _make_plan(layout.ops, self.fusions.backward, "backward")
            self._plans = (self.fusions.version, layout, fwd, bwd)
            logger.debug("fusion plan: forward %s, backward %s", self.forward_ops, self.backward_ops)
        return self._plans[1], self._plans[2], self._plans[3]

    @property
    def forward_ops(self) -> list[Op]:
        """The forward plan's ops (basic or fused), for inspection."""
        return [op for op, _ in self.plans()[1].steps]

    @property
    def backward_ops(self) -> list[Op]:
        """The backward plan's ops (basic or fused) in forward order; backward runs them reversed."""
        return [op for op, _ in self.plans()[2].steps]

    def __call__(self, x: torch.Tensor, extra_inputs: Sequence[Any] = ()) -> torch.Tensor:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"fusible ops take a tensor input, got {type(x).__name__}")
        for op in self.ops:
            op.pre_forward()
        layout, fwd, bwd = self.plans()
        basic = layout.ops
        if len(extra_inputs) != layout.n_extra:
            raise ValueError(
                f"ops {[type(b).__name__ for b in basic]} take {layout.n_extra} extra input(s) "
                f"(e.g. GroupedLinear's split_sizes), got {len(extra_inputs)}"
            )
        per_op = [tuple(extra_inputs[a:b]) for a, b in layout.extra_spans]
        params = [b.op_parameters() for b in basic]
        flat_params = [p for ps in params for p in ps]
        state = _State(basic, fwd, bwd, per_op, [len(ps) for ps in params], torch.is_grad_enabled())
        if any(getattr(b, "splits_wgrad", None) is not None and b.splits_wgrad() for b in basic):
            return apply_outside_compile(_FuserFunction, x, state, *flat_params)  # torch.compile: see core
        return _FuserFunction.apply(x, state, *flat_params)


class _State:
    """Everything one fuser call hands its autograd Function besides tensors."""

    __slots__ = (
        "backward_plan",
        "basic",
        "ctxs",
        "extra_inputs",
        "forward_plan",
        "grad_enabled",
        "n_params",
        "spans",
    )

    def __init__(self, basic, forward_plan, backward_plan, extra_inputs, n_params, grad_enabled) -> None:
        self.basic: list[Fusible] = basic
        self.forward_plan: _Plan = forward_plan
        self.backward_plan: _Plan = backward_plan
        self.extra_inputs: list[tuple[Any, ...]] = extra_inputs
        self.n_params: list[int] = n_params
        self.grad_enabled: bool = grad_enabled
        self.ctxs: list[OperationContext] = []
        self.spans: list[tuple[int, int]] = []


class _FuserFunction(torch.autograd.Function):
    """One autograd node for a run of ops: forward plan forward, backward plan reversed."""

    @staticmethod
    def forward(func_ctx, x: torch.Tensor, state: _State, *params: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        # Which ops need backward at all: an op needs dx if anything before it (or x) needs a gradient.
        grad_enabled = state.grad_enabled
        ctxs, upstream, pos = [], grad_enabled and x.requires_grad, 0
        for n in state.n_params:
            weights = False
            if grad_enabled:
                for p in params[pos : pos + n]:
                    weights = weights or p.requires_grad
            ctxs.append(OperationContext(upstream, weights))
            upstream = upstream or weights
            pos += n
        extra = state.extra_inputs
        for op, span in state.forward_plan.steps:
            a, b = span.start, span.stop
            x = op.fuser_forward(ctxs[a:b], x, extra[a:b])
        if upstream:
            flat, spans = [], state.spans
            for c in ctxs:
                spans.append((len(flat), len(flat) + len(c.to_save)))
                flat.extend(c.to_save)
                c.to_save = ()
            func_ctx.save_for_backward(*flat)
        state.ctxs = ctxs
        state.extra_inputs = []  # not needed any more; may hold a split-sizes tensor
        func_ctx.state = state
        return x

    @staticmethod
    @split_backward
    def backward(func_ctx, dy: torch.Tensor):  # type: ignore[override]
        state: _State = func_ctx.state
        saved = func_ctx.saved_tensors
        for c, (a, b) in zip(state.ctxs, state.spans):
            c.saved_tensors = saved[a:b]
            c.create_graph = func_ctx.create_graph
        grads: list[Any] = [None] * len(state.basic)
        try:
            ctxs = state.ctxs
            for op, span in reversed(state.backward_plan.steps):
                dy, op_grads = op.fuser_backward(ctxs[span.start : span.stop], dy)
                if len(op_grads) != len(span):
                    raise RuntimeError(
                        f"{op!r}.fuser_backward returned gradients for {len(op_grads)} op(s), expected {len(span)}"
                    )
                grads[span.start : span.stop] = op_grads
        finally:
            # Saved tensors live with the graph (retain_graph re-runs restore them), not with the contexts.
            for c in state.ctxs:
                c.saved_tensors = ()
        flat: list[torch.Tensor | None] = []
        for op, g, n in zip(state.basic, grads, state.n_params):
            if g is None:
                flat.extend([None] * n)
            elif len(g) != n:
                raise RuntimeError(
                    f"{op._describe()}.op_backward returned {len(g)} parameter gradient(s), expected {n} "
                    "(one per op_parameters())"
                )
            else:
                flat.extend(g)
        dx = dy if func_ctx.needs_input_grad[0] else None
        return dx, None, *flat
