"""Batch-level overlap: one microbatch's forward runs while another's backward runs, each hiding the other's
all-to-alls (Megatron-Core's ``--overlap-moe-expert-parallel-comm``, DualPipe's overlapped chunk).

The forward of microbatch ``i + 1`` runs on the calling thread and the backward of microbatch ``i`` on a
second thread. Whenever one of them waits for a dispatch/combine exchange (gloo and NCCL waits release the
GIL), the other computes: attention, routing and expert GEMMs of one fill the all-to-all of the other, at
sub-layer granularity, without splitting the autograd graph by hand. The two parts exchange over different
process groups (the layers' ``ep_group`` forward, ``backward_group`` backward, same ranks), so every rank
issues each group's collectives in the same order. Only the backward writes gradients, so they accumulate in
the same order as running the parts one after the other: training is bit-for-bit the same.

With deferred wgrad, each MoE layer's expert weight gradients of the backward part run while that layer's
backward dispatch all-to-all is in flight (Megatron-Core's ``--delay-wgrad-compute`` placement), in the order
``backward_dw`` would have run them (see ``dispatch_wgrad.py``); the dense layers' stay deferred.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Any

import torch
from torch import nn

from .baton import ComputeBaton
from .layer import ExpertParallelMoEMLP

__all__ = ["OverlappedMoEStage", "overlapped_forward_backward", "set_wgrad_in_dispatch"]

logger = logging.getLogger(__name__)


def overlapped_forward_backward(
    module: nn.Module,
    x: Any,
    y: torch.Tensor,
    dy: torch.Tensor | None = None,
    *,
    timeout: float | None = 600.0,
    wgrad_in_dispatch: bool | None = True,
    thread_stats: dict | None = None,
    exclusive_compute: bool = False,
) -> Any:
    """Return ``module(x)`` while ``torch.autograd.backward(y, dy)`` runs concurrently.

    Args:
        module: a model or pipeline stage whose expert-parallel layers have a separate ``backward_group``, or
            its splitgrad data-parallel wrapper (e.g. :class:`~splitgrad.parallel.expert.ExpertDataParallel`;
            the pair then runs inside its ``no_sync()``: the backward part never starts a reduction).
        x: the forward part's input (e.g. ``ids: (batch, seq)`` or activations ``(batch, seq, hidden)``).
        y: the backward part's output (a loss or a stage output), from an earlier forward of ``module``.
        dy: its gradient, same shape as ``y`` (None for a scalar loss).
        timeout: seconds to wait for the backward after the forward finished (None: forever).
        wgrad_in_dispatch: for the call, set the ``wgrad_in_dispatch`` of ``module``'s expert layers: True runs
            each layer's deferred expert weight gradients (delayed wgrad only) while its backward dispatch
            all-to-all is in flight instead of leaving them to ``backward_dw`` / the bundle (skipped for a layer
            whose older deferred work is still owed elsewhere: it would change the accumulation order); None
            leaves the layers' own settings (:func:`set_wgrad_in_dispatch`; needed when ``y`` comes from
            another module, e.g. another pipeline stage).
        thread_stats: when given, filled with ``{"forward": {...}, "backward": {...}}``: each part's thread
            ``start`` / ``end`` (``time.perf_counter()`` seconds), ``cpu`` (its thread's CPU seconds, load
            independent), ``num_threads`` (``torch.get_num_threads()`` seen by that thread) and, where the OS
            reports them, ``voluntary`` / ``involuntary`` context switches of that thread (diagnostics), plus
            ``handoffs`` (waits that gave the baton up) and ``baton_waits`` (``(start, end)`` of each wait to take
            it back, the other part computing) with ``exclusive_compute``.
        exclusive_compute: only one part computes at a time; each gives the core to the other exactly while it
            waits for an exchange (a :class:`~splitgrad.parallel.expert.baton.ComputeBaton`), instead of the OS
            time-slicing two runnable threads. Same arithmetic, same gradients (bitwise).

    Returns:
        ``module(x)``.

    Raises:
        ValueError: an expert-parallel layer exchanges forward and backward over the same group, or ``module``
            is the bare model under a data-parallel wrapper (pass the wrapper).
        RuntimeError: the backward raised (chained) or did not finish within ``timeout``.
    """
    layers = {name: m for name, m in module.named_modules() if isinstance(m, ExpertParallelMoEMLP)}
    shared = [name for name, m in layers.items() if m.backward_group is m.ep_group]
    if shared:
        raise ValueError(
            f"overlapped_forward_backward: expert-parallel layers {shared} use one group for forward and backward "
            "all-to-alls; concurrent parts would interleave their collectives differently on each rank. Build "
            "the model with ep_backward_group (a second group of the same ranks)"
        )
    if not _is_data_parallel(module):
        wrapped = [name for name, p in module.named_parameters() if hasattr(p, "grad_added_to_main_grad")]
        if wrapped:
            raise ValueError(
                f"overlapped_forward_backward: {type(module).__name__}'s parameters {wrapped[:3]} are managed by a "
                "data-parallel wrapper (they carry grad_added_to_main_grad); pass the wrapper (e.g. the "
                "ExpertDataParallel) as module: it counts the forward part and keeps the backward part inside "
                "no_sync(), so no reduction starts from the backward thread"
            )
    errors: list[BaseException] = []

    baton = ComputeBaton(log=[] if thread_stats is not None else None) if exclusive_compute else None

    def backward() -> None:
        if baton is not None:
            baton.acquire()  # the forward part holds it until its first wait
        probe = _ThreadProbe(thread_stats, "backward")
        try:
            with torch.profiler.record_function("splitgrad.overlap.backward"):
                torch.autograd.backward(y, dy)
        except BaseException as exc:  # re-raised on the calling thread
            errors.append(exc)
        finally:
            probe.stop()
            if baton is not None:
                baton.release()

    before = {name: (m.wgrad_in_dispatch, m.compute_baton) for name, m in layers.items()}
    for m in layers.values():
        m.wgrad_in_dispatch = m.wgrad_in_dispatch if wgrad_in_dispatch is None else wgrad_in_dispatch
        m.compute_baton = baton
    # Under a splitgrad data-parallel wrapper the backward part's wgrad hooks fire on the backward thread while
    # the forward part issues its all-to-alls and aux-loss all-reduce (over the model's dp_group, often the
    # wrappers' group too). A bucket started from there would interleave with those collectives in a
    # different order on each rank (gloo pairs collectives of a group by issue order: a mismatch or a hang).
    # The pair's backward is never the step's last microbatch (the forward part's microbatch is still to
    # come), so its contributions must only accumulate: the pair runs inside the wrapper's no_sync(), and
    # every bucket starts later, on the calling thread, from the hooks of the last microbatch's B / W.
    sync_off = module.no_sync() if _is_data_parallel(module) else contextlib.nullcontext()
    thread = threading.Thread(target=backward, name="splitgrad-overlap-backward", daemon=True)
    with sync_off:
        if baton is not None:
            baton.acquire()
        thread.start()
        probe = _ThreadProbe(thread_stats, "forward")
        try:
            with torch.profiler.record_function("splitgrad.overlap.forward"):
                out = module(x)
        finally:
            probe.stop()
            if baton is not None:
                baton.release()
            thread.join(timeout)
            if not thread.is_alive():  # a backward still running keeps reading the flags
                for name, m in layers.items():
                    m.wgrad_in_dispatch, m.compute_baton = before[name]
    if thread_stats is not None and baton is not None:
        thread_stats["handoffs"] = baton.handoffs
        thread_stats["baton_waits"] = list(baton.log or [])
    if thread.is_alive():
        raise RuntimeError(
            f"overlapped_forward_backward: the backward part did not finish within {timeout} s"
        )
    if errors:
        raise RuntimeError(f"overlapped_forward_backward: the backward part failed: {errors[0]}") from errors[
            0
        ]
    return out


class _ThreadProbe:
    """Per-thread wall span, CPU time and context switches of one part of the pair (``thread_stats``)."""

    def __init__(self, stats: dict | None, part: str) -> None:
        self.stats, self.part = stats, part
        if stats is not None:
            self.usage = _thread_usage()
            self.start, self.cpu = time.perf_counter(), time.thread_time()

    def stop(self) -> None:
        if self.stats is None:
            return
        end, cpu = time.perf_counter(), time.thread_time()
        entry = {
            "start": self.start,
            "end": end,
            "cpu": cpu - self.cpu,
            "num_threads": torch.get_num_threads(),
        }
        usage = _thread_usage()
        if usage is not None and self.usage is not None:
            entry["voluntary"] = usage[0] - self.usage[0]
            entry["involuntary"] = usage[1] - self.usage[1]
        self.stats[self.part] = entry


def _thread_usage() -> tuple[int, int] | None:
    """(voluntary, involuntary) context switches of the calling thread, where the OS reports them (Linux)."""
    try:
        import resource

        usage = resource.getrusage(resource.RUSAGE_THREAD)
    except (ImportError, AttributeError, OSError):
        return None
    return usage.ru_nvcsw, usage.ru_nivcsw


def _is_data_parallel(module: nn.Module) -> bool:
    """A splitgrad data-parallel wrapper (``DistributedDataParallel``, ``ExpertDataParallel``): the same duck
    test as the pipeline runtime's."""
    return callable(getattr(module, "no_sync", None)) and callable(getattr(module, "finish_grad_sync", None))


class OverlappedMoEStage(nn.Module):
    """``module`` with an ``overlapped_forward_backward(x, y, dy)`` method (what the pipeline runtime calls for an
    overlapped ``F+B`` action, see ``docs/pipeline_runtime.md``). Shapes: as ``module``."""

    def __init__(
        self,
        module: nn.Module,
        *,
        timeout: float | None = 600.0,
        wgrad_in_dispatch: bool | None = True,
        exclusive_compute: bool = False,
    ) -> None:
        super().__init__()
        self.module = module
        self.timeout = timeout
        self.wgrad_in_dispatch = wgrad_in_dispatch
        self.exclusive_compute = exclusive_compute

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def overlapped_forward_backward(self, x: Any, y: torch.Tensor, dy: torch.Tensor | None = None) -> Any:
        """``self(x)`` while ``torch.autograd.backward(y, dy)`` runs (see :func:`overlapped_forward_backward`)."""
        return overlapped_forward_backward(
            self.module,
            x,
            y,
            dy,
            timeout=self.timeout,
            wgrad_in_dispatch=self.wgrad_in_dispatch,
            exclusive_compute=self.exclusive_compute,
        )


def set_wgrad_in_dispatch(model: nn.Module, enabled: bool) -> int:
    """Turn ``wgrad_in_dispatch`` on or off for every expert-parallel MoE layer of ``model``.

    On, every backward of a layer (overlapped or not, plain ``loss.backward()`` or a pipeline ``B``/``BW``) runs
    the experts' deferred weight gradients inside its dispatch all-to-all; in a pipeline that moves the expert
    part of a ``W`` action into its ``B`` (the dense part stays in ``W``). Needed for pipeline pairs whose
    backward part is another stage than the forward part (``dualpipev``), which
    ``overlapped_forward_backward`` cannot see.

    Args:
        model: a model or stage holding :class:`~splitgrad.parallel.expert.ExpertParallelMoEMLP` layers.
        enabled: the new setting.

    Returns:
        The number of layers set.
    """
    layers = [m for m in model.modules() if isinstance(m, ExpertParallelMoEMLP)]
    for layer in layers:
        layer.wgrad_in_dispatch = bool(enabled)
    return len(layers)
