"""``make_graphed_callables``: capture layers as forward, backward and (separate) wgrad graphs."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from .backend import GraphBackend, resolve_backend
from .capture import Owners, UnitCapture, warmup_once
from .order import default_order, normalize_order
from .targets import ParamStateSnapshot

__all__ = ["make_graphed_callables"]

logger = logging.getLogger(__name__)


def _check_callable(fn: object, args: object, index: int) -> tuple[torch.Tensor, ...]:
    if not callable(fn):
        raise ValueError(f"callable {index} is not callable: {type(fn).__name__}")
    if isinstance(args, torch.Tensor) or not isinstance(args, (tuple, list)):
        raise ValueError(f"sample_args[{index}] must be a tuple of tensors, got {type(args).__name__}")
    bad = [i for i, a in enumerate(args) if not isinstance(a, torch.Tensor)]
    if bad:
        raise ValueError(
            f"sample_args[{index}] must contain only tensors (non-tensor arguments cannot be graph inputs), "
            f"positions {bad} are not"
        )
    if isinstance(fn, nn.Module):
        for name, module in fn.named_modules():
            hooks = (
                module._forward_hooks,
                module._forward_pre_hooks,
                module._backward_hooks,
                module._backward_pre_hooks,
            )
            if any(hooks):
                raise ValueError(
                    f"callable {index}: module {name or type(module).__name__!r} has forward/backward hooks; they "
                    "are Python and would run at capture only, never on replay. Remove them before capture "
                    "(wgrad hooks via register_wgrad_accumulation_and_reduce_hooks are fine)."
                )
        trainable_buffers = [n for n, b in fn.named_buffers() if b.requires_grad]
        if trainable_buffers:
            raise ValueError(
                f"callable {index}: buffers {trainable_buffers} require grad; only parameters may"
            )
    return tuple(args)


def make_graphed_callables(
    callables: Any,
    sample_args: Any,
    *,
    num_warmup_iters: int = 3,
    allow_unused_input: bool = False,
    backend: str | GraphBackend = "auto",
    order: Iterable[object] | None = None,
    stages: Sequence[int] | None = None,
) -> Any:
    """Capture callables (modules, ops, ``Sequential``\\ s) as graphs, with deferred wgrad in its own graph.

    For each callable: ``num_warmup_iters`` eager iterations, then a forward graph, a backward graph (input
    gradients and every weight gradient that is not deferred, ``main_grad`` accumulation included) and, when
    any captured layer has ``delay_wgrad_compute=True``, a wgrad graph replayed by ``backward_dw()``.

    Gradients accumulate as in eager mode. Weight gradients that a layer writes itself (deferred or fused) go to
    buffers fixed at capture: ``.grad`` may be zeroed in place or set to ``None`` (the next write starts from
    zero), never replaced by another tensor; ``main_grad`` must stay the same tensor. Capture leaves every
    gradient, ``main_grad`` and ``grad_added_to_main_grad`` as it found them.

    Args:
        callables: one callable or a tuple of them; ``nn.Module``\\ s contribute their parameters, and their
            split-capable submodules (anything with a ``wgrad_store``) are found automatically.
        sample_args: a tuple of tensors (one callable) or a tuple of such tuples; shapes, dtypes, devices and
            ``requires_grad`` must match the real calls.
        num_warmup_iters: eager iterations before capture (>= 1: the first one creates the ``.grad`` buffers).
        allow_unused_input: accept inputs/parameters that require grad but get none.
        backend: ``"auto"`` (CUDA graphs for CUDA tensors, the CPU stand-in for CPU tensors), ``"cuda"``,
            ``"cpu"`` or a :class:`~splitgrad.graphs.backend.GraphBackend`.
        order: capture order for a pipeline runtime, e.g. one rank's action list ``["0F0", "0F1", "0B0", "0W0",
            ...]`` (kinds ``F``, ``B``, ``W``, ``BW``); every (stage, microbatch) gets its own graphs and static
            buffers. Replay them in this order: the graphs share one memory pool.
        stages: the stage id each callable answers to in ``order`` (default ``0 .. len(callables) - 1``).

    Returns:
        Without ``order``: a :class:`GraphedCallable` (one callable) or a tuple of them. With ``order``: a tuple
        over callables of tuples over microbatches, ``result[i][m]``.

    Raises:
        ValueError: malformed arguments or order, module hooks, trainable buffers.
        GraphCaptureError: the callable does something a graph cannot hold (data-dependent ops, ...).
    """
    autocast_on = [d for d in ("cuda", "cpu") if torch.is_autocast_enabled(d)]
    if autocast_on and torch.is_autocast_cache_enabled():
        raise RuntimeError(
            f"make_graphed_callables under autocast({autocast_on[0]!r}) needs cache_enabled=False: the autocast "
            "weight-cast cache is not graph-safe (torch.cuda.make_graphed_callables has the same rule)"
        )
    if isinstance(num_warmup_iters, bool) or not isinstance(num_warmup_iters, int) or num_warmup_iters < 1:
        raise ValueError(
            f"num_warmup_iters must be an int >= 1 (the first iteration creates the static .grad buffers), "
            f"got {num_warmup_iters=}"
        )
    single = not isinstance(callables, (tuple, list))
    fns = (callables,) if single else tuple(callables)
    samples = (sample_args,) if single else tuple(sample_args)
    if not fns or len(samples) != len(fns):
        raise ValueError(f"need one sample-args tuple per callable, got {len(fns)=} {len(samples)=}")
    samples = tuple(_check_callable(fn, args, i) for i, (fn, args) in enumerate(zip(fns, samples)))
    stage_ids = list(range(len(fns))) if stages is None else [int(s) for s in stages]
    if len(stage_ids) != len(fns):
        raise ValueError(f"stages must name one stage per callable, got {len(stage_ids)=} for {len(fns)=}")

    graph_backend = resolve_backend(backend, samples)
    owners = [Owners(fn) for fn in fns]
    defers = [o.defers() for o in owners]
    if order is None:
        actions, num_microbatches = default_order(defers), 1
    else:
        actions, num_microbatches = normalize_order(order, stages=stage_ids, defers=defers)

    units = {
        (i, m): UnitCapture(
            fn,
            samples[i],
            owners=owners[i],
            label=f"{type(fn).__name__}[{stage_ids[i]}]" + (f".mb{m}" if num_microbatches > 1 else ""),
            stage=stage_ids[i],
            microbatch=m,
            allow_unused_input=allow_unused_input,
        )
        for i, fn in enumerate(fns)
        for m in range(num_microbatches)
    }
    all_params = [p for fn in fns if isinstance(fn, nn.Module) for p in fn.parameters()]
    candidates = {id(p): p for o in owners for p in o.candidates()}
    snapshot = ParamStateSnapshot(all_params)
    logger.info(
        "capturing %d callable(s) x %d microbatch(es) with the %s backend (%d capture steps)",
        len(fns),
        num_microbatches,
        graph_backend.name,
        len(actions),
    )
    try:
        # Warm-up: the first iteration reveals which parameters get a `.grad` written by the layer itself;
        # that tensor (or the user's pre-existing `.grad`) becomes the static buffer every graph adds into.
        for p in candidates.values():
            p.grad = None
        buffers: dict[int, torch.Tensor] = {}
        warm_inputs = [tuple(u.static_inputs) for (i, m), u in units.items() if m == 0]
        with graph_backend.warmup():
            for it in range(num_warmup_iters):
                for i, fn in enumerate(fns):
                    warmup_once(fn, warm_inputs[i], units[(i, 0)].params, owners[i])
                if it == 0:
                    for key, p in candidates.items():
                        if p.grad is not None:
                            original = snapshot.original_grad(p)
                            buffers[key] = p.grad if original is None else original
                            p.grad = buffers[key]
        # Capture in the given order (the graphs share memory, so replay must follow it).
        steps = {
            "F": UnitCapture.capture_forward,
            "B": UnitCapture.capture_backward,
            "W": UnitCapture.capture_wgrad,
        }
        for action in actions:
            steps[action.kind](units[(action.stage, action.microbatch)], graph_backend)
        graphed = {key: unit.finish(buffers) for key, unit in units.items()}
    except BaseException:
        for unit in units.values():
            unit.abort()
        raise
    finally:
        snapshot.restore()

    if order is not None:
        return tuple(tuple(graphed[(i, m)] for m in range(num_microbatches)) for i in range(len(fns)))
    result = tuple(graphed[(i, 0)] for i in range(len(fns)))
    return result[0] if single else result
