"""The driver of batch-level overlap: one microbatch's forward interleaved, step by step, with another's backward
on one thread (``overlapped_forward_backward``; Megatron-Core's ``combined_1f1b``, DualPipe's
``overlapped_forward_backward``).

The forward part is a generator of steps (:mod:`splitgrad.core.steps`): each step runs until it has *issued* its
next dispatch/combine all-to-all and yields with it in flight. The backward part is a plain
``torch.autograd.backward(y, dy)`` on the same thread. Before it starts, the driver walks ``y``'s autograd graph
once and binds itself to every all-to-all node found there (the backward's exchanges, whichever module or
pipeline stage they belong to, e.g. dualpipev's other stage); each of them, after issuing its exchange (and
running the experts' deferred weight gradients inside the dispatch backward), advances the forward by one step,
then waits. So each part's exchange is in flight while the other computes, and:

* every rank issues the same collectives in the same order (the interleave is a fixed program, not a thread
  race): forward and backward may share one process group;
* one thread computes: no GIL contention, no time-slicing of two parts' GEMMs on one core.

Order (Megatron-Core's combined 1F1B): the backward runs first; its first exchange runs the forward's first step
(up to its first dispatch), each later backward exchange one more step, and the forward's remaining steps run
after the backward. So every exchange has a whole compute block of the other part over it: the backward's first
combine the forward's attention, the forward's first dispatch the backward's expert dgrad. Running the forward's
first step before the backward (``forward_first=True``) left that dispatch under the loss and head backward
only, a few ms (exposed on a slow link). Gradients accumulate exactly as when running the backward, then the
forward: bitwise the same training in either order. The binding lives on the graph's own nodes for the
duration of the call (no module-level state) and is removed afterwards.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ....core.steps import child_steps
from ..all_to_all import AllToAll
from .probe import ThreadProbe

__all__ = ["bind_backward_exchanges", "run_pair_in_steps"]

logger = logging.getLogger(__name__)


class _ForwardPartError(RuntimeError):
    """The forward part raised while the driver advanced it (possibly from inside the backward)."""


class _ForwardPart:
    """The forward part's generator, advanced one step at a time; accounts the CPU time its steps took."""

    def __init__(self, module: nn.Module, x: Any) -> None:
        self._steps = child_steps(module, x)
        self._grad_enabled = torch.is_grad_enabled()  # the engine disables it inside backward nodes
        self.done, self.output = False, None
        self.steps = 0  # resumptions that ended at a yield
        self.in_backward = 0  # advances made from inside a backward exchange
        self.cpu = 0.0
        self.start: float | None = None
        self.end: float | None = None

    def advance(self) -> None:
        """Run the next step (nothing once the forward finished); raise :class:`_ForwardPartError` on error."""
        if self.done:
            return
        start, cpu = time.perf_counter(), time.thread_time()
        self.start = start if self.start is None else self.start
        try:
            with (
                torch.set_grad_enabled(self._grad_enabled),
                torch.profiler.record_function("splitgrad.overlap.step"),
            ):
                next(self._steps)
            self.steps += 1
        except StopIteration as stop:
            self.done, self.output = True, stop.value
        except (
            Exception
        ) as exc:  # KeyboardInterrupt & co. pass unwrapped (the generator is closed all the same)
            self.done = True
            raise _ForwardPartError(str(exc)) from exc
        finally:
            self.cpu += time.thread_time() - cpu
            self.end = time.perf_counter()

    def advance_in_backward(self) -> None:
        """:meth:`advance`, called by a backward exchange while it is in flight."""
        if not self.done:
            self.in_backward += 1
        self.advance()

    def close(self) -> None:
        """Abandon an unfinished forward; its exchange in flight is waited first (see ``await_exchange``)."""
        self._steps.close()


def bind_backward_exchanges(y: torch.Tensor | Sequence[torch.Tensor], advance: Any) -> list:
    """Set ``advance_pair = advance`` on every all-to-all node of ``y``'s autograd graph; return those nodes.

    Args:
        y: the backward part's output(s).
        advance: called by each bound node while its backward exchange is in flight.

    Returns:
        The bound nodes (unbind them with ``node.advance_pair = None``), in no particular order.
    """
    roots = [y] if isinstance(y, torch.Tensor) else list(y)
    stack = [t.grad_fn for t in roots if t.grad_fn is not None]
    seen: dict[int, object] = {}  # holds the nodes, so an id is never reused during the walk
    bound = []
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen[id(node)] = node
        if isinstance(node, AllToAll._backward_cls):
            node.advance_pair = advance
            bound.append(node)
        stack.extend(child for child, _ in node.next_functions)
    return bound


def run_pair_in_steps(
    module: nn.Module,
    x: Any,
    y: torch.Tensor,
    dy: torch.Tensor | None,
    stats: dict | None = None,
    *,
    forward_first: bool = False,
) -> Any:
    """``module(x)`` interleaved on this thread with ``torch.autograd.backward(y, dy)`` (see the module docstring).

    Args:
        module: the forward part's module (its ``forward_steps`` is walked where it has one).
        x: its input.
        y: the backward part's output; ``dy`` its gradient (None for a scalar).
        stats: when given, filled with ``"forward"`` (first / last step ``start`` / ``end``, ``cpu`` spent in its
            steps, ``steps``, ``in_backward``: steps advanced from inside a backward exchange, ``num_threads``),
            ``"backward"`` (``start`` / ``end`` of the backward, its ``cpu`` without the forward steps run inside,
            ``num_threads``) and ``"pair"`` (the whole call: ``start``, ``end``, ``cpu``, ``voluntary`` /
            ``involuntary`` context switches where the OS reports them).
        forward_first: run the forward's first step before the backward starts (the earlier order); by default
            the backward's first exchange runs it.

    Returns:
        ``module(x)``.

    Raises:
        RuntimeError: naming the part (forward or backward) that raised, chained to its error.
    """
    pair_probe = ThreadProbe(stats, "pair")
    part = _ForwardPart(module, x)
    bound: list = []
    backward_span = (0.0, 0.0, 0.0)
    try:
        bound = bind_backward_exchanges(y, part.advance_in_backward)
        if forward_first:
            part.advance()  # the forward's first step: up to its first dispatch, in flight under the backward
        cpu_before, fwd_cpu_before, start = time.thread_time(), part.cpu, time.perf_counter()
        try:
            with torch.profiler.record_function("splitgrad.overlap.backward"):
                torch.autograd.backward(y, dy)
        except _ForwardPartError:
            raise
        except Exception as exc:
            raise RuntimeError(f"overlapped_forward_backward: the backward part failed: {exc}") from exc
        backward_span = (
            start,
            time.perf_counter(),
            time.thread_time() - cpu_before - (part.cpu - fwd_cpu_before),
        )
        while not part.done:
            part.advance()
    except _ForwardPartError as exc:
        cause = exc.__cause__ if exc.__cause__ is not None else exc
        raise RuntimeError(f"overlapped_forward_backward: the forward part failed: {cause}") from cause
    finally:
        for node in bound:
            node.advance_pair = None
        part.close()
    if stats is not None:
        pair_probe.stop()
        threads = torch.get_num_threads()
        stats["forward"] = {
            "start": part.start,
            "end": part.end,
            "cpu": part.cpu,
            "steps": part.steps,
            "in_backward": part.in_backward,
            "num_threads": threads,
        }
        stats["backward"] = {
            "start": backward_span[0],
            "end": backward_span[1],
            "cpu": backward_span[2],
            "num_threads": threads,
        }
    return part.output
