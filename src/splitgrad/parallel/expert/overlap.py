"""Batch-level overlap: one microbatch's forward runs while another's backward runs, each hiding the other's
all-to-alls (Megatron-Core's ``--overlap-moe-expert-parallel-comm``, DualPipe's overlapped chunk).

Two drivers (``"steps"`` is the default):

* ``driver="threads"``: the forward of microbatch ``i + 1`` runs on the calling thread and the backward of
  microbatch ``i`` on a second thread. Whenever one of them waits for a dispatch/combine exchange (gloo and NCCL
  waits release the GIL), the other computes, without splitting the autograd graph by hand. The two parts
  exchange over different process groups (the layers' ``ep_group`` forward, ``backward_group`` backward, same
  ranks), so every rank issues each group's collectives in the same order. The forward starts once the
  backward's first exchange is in flight; from then on who computes when is up to the OS (or, with
  ``exclusive_compute``, a baton handed over at every wait).
* ``driver="steps"``: one thread, a fixed interleave at sub-layer granularity (``step_driver.py``): the forward
  runs as steps that each end by issuing an exchange, and every backward exchange advances the forward by one
  step while it is in flight. Every rank issues the same collectives in the same order, so the parts may share
  one group.

Only the backward writes gradients, so they accumulate in the same order as running the parts one after the
other: training is bit-for-bit the same with either driver.

With deferred wgrad, each MoE layer's expert weight gradients of the backward part run while that layer's
backward dispatch all-to-all is in flight (Megatron-Core's ``--delay-wgrad-compute`` placement), in the order
``backward_dw`` would have run them (see ``dispatch_wgrad.py``); the dense layers' stay deferred.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Any

import torch
from torch import nn

from ...core.steps import Steps, child_steps
from .baton import ComputeBaton
from .layer import ExpertParallelMoEMLP
from .probe import ThreadProbe
from .step_driver import bind_backward_exchanges, run_pair_in_steps

__all__ = ["DRIVERS", "OverlappedMoEStage", "overlapped_forward_backward", "set_wgrad_in_dispatch"]

logger = logging.getLogger(__name__)


#: The drivers of :func:`overlapped_forward_backward` (see the module docstring).
DRIVERS = ("threads", "steps")


def overlapped_forward_backward(
    module: nn.Module,
    x: Any,
    y: torch.Tensor,
    dy: torch.Tensor | None = None,
    *,
    driver: str = "steps",
    timeout: float | None = 600.0,
    wgrad_in_dispatch: bool | None = True,
    thread_stats: dict | None = None,
    exclusive_compute: bool = False,
) -> Any:
    """Return ``module(x)`` while ``torch.autograd.backward(y, dy)`` runs interleaved with it.

    Args:
        module: a model or pipeline stage holding expert-parallel layers, or its splitgrad data-parallel wrapper
            (e.g. :class:`~splitgrad.parallel.expert.ExpertDataParallel`; the pair then runs inside its
            ``no_sync()``: the backward part never starts a reduction). With ``driver="threads"`` its layers
            need a separate ``backward_group``.
        x: the forward part's input (e.g. ``ids: (batch, seq)`` or activations ``(batch, seq, hidden)``).
        y: the backward part's output (a loss or a stage output), from an earlier forward of ``module``.
        dy: its gradient, same shape as ``y`` (None for a scalar loss).
        driver: ``"steps"`` (default: one thread, the forward advanced one step at each backward exchange,
            Megatron-Core's combined-1F1B order; see ``step_driver.py``) or ``"threads"`` (the backward on a
            second thread; the OS or the baton decides who computes). Measured on 2 gloo ranks in a rate-limited
            namespace, ``"steps"`` hid more of the all-to-all time in every row (README).
        timeout: ``"threads"``: seconds to wait for the backward's first exchange before the forward starts anyway,
            and for the backward after the forward finished (None: forever).
            ``"steps"`` runs everything on the calling thread; each exchange wait has its group's timeout.
        wgrad_in_dispatch: for the call, set the ``wgrad_in_dispatch`` of ``module``'s expert layers: True runs
            each layer's deferred expert weight gradients (delayed wgrad only) while its backward dispatch
            all-to-all is in flight instead of leaving them to ``backward_dw`` / the bundle (skipped for a layer
            whose older deferred work is still owed elsewhere: it would change the accumulation order); None
            leaves the layers' own settings (:func:`set_wgrad_in_dispatch`; needed when ``y`` comes from
            another module, e.g. another pipeline stage).
        thread_stats: when given, filled with ``{"forward": {...}, "backward": {...}}``: each part's
            ``start`` / ``end`` (``time.perf_counter()`` seconds), ``cpu`` (CPU seconds, load independent),
            ``num_threads`` (``torch.get_num_threads()``). ``"threads"``: per thread, plus, where the OS reports
            them, ``voluntary`` / ``involuntary`` context switches of that thread, and ``handoffs`` / ``baton_waits``
            with ``exclusive_compute``. ``"steps"``: the forward's ``cpu`` is the time spent in its steps and
            the backward's the rest of the backward; ``"pair"`` holds the whole call's span, CPU and context
            switches (see :func:`~splitgrad.parallel.expert.step_driver.run_pair_in_steps`).
        exclusive_compute: ``"threads"`` only: only one part computes at a time; each gives the core to the other
            exactly while it waits for an exchange (a :class:`~splitgrad.parallel.expert.baton.ComputeBaton`),
            instead of the OS time-slicing two runnable threads. Same arithmetic, same gradients (bitwise).

    Returns:
        ``module(x)``.

    Raises:
        ValueError: an unknown ``driver``; ``exclusive_compute`` with ``driver="steps"``; with ``"threads"``, an
            expert-parallel layer exchanging forward and backward over the same group; ``module`` is the bare
            model under a data-parallel wrapper (pass the wrapper).
        RuntimeError: a part raised (named, chained) or, with ``"threads"``, the backward did not finish within
            ``timeout``.
    """
    if driver not in DRIVERS:
        raise ValueError(f"overlapped_forward_backward: driver must be one of {DRIVERS}, got {driver=}")
    if exclusive_compute and driver != "threads":
        raise ValueError(
            f"overlapped_forward_backward: exclusive_compute=True applies to driver='threads' only, got {driver=} "
            "(the steps driver computes on one thread already)"
        )
    layers = {name: m for name, m in module.named_modules() if isinstance(m, ExpertParallelMoEMLP)}
    shared = [name for name, m in layers.items() if m.backward_group is m.ep_group]
    if shared and driver == "threads":
        raise ValueError(
            f"overlapped_forward_backward: expert-parallel layers {shared} use one group for forward and backward "
            "all-to-alls; concurrent parts would interleave their collectives differently on each rank. Build "
            "the model with ep_backward_group (a second group of the same ranks), or use driver='steps'"
        )
    if not _is_data_parallel(module):
        wrapped = [name for name, p in module.named_parameters() if hasattr(p, "grad_added_to_main_grad")]
        if wrapped:
            raise ValueError(
                f"overlapped_forward_backward: {type(module).__name__}'s parameters {wrapped[:3]} are managed by a "
                "data-parallel wrapper (they carry grad_added_to_main_grad); pass the wrapper (e.g. the "
                "ExpertDataParallel) as module: it counts the forward part and keeps the backward part inside "
                "no_sync(), so no reduction starts from the backward part"
            )
    baton = ComputeBaton(log=[] if thread_stats is not None else None) if exclusive_compute else None
    before = {name: (m.wgrad_in_dispatch, m.compute_baton) for name, m in layers.items()}
    for m in layers.values():
        m.wgrad_in_dispatch = m.wgrad_in_dispatch if wgrad_in_dispatch is None else wgrad_in_dispatch
        m.compute_baton = baton
    # Under a splitgrad data-parallel wrapper the backward part's wgrad hooks fire while the forward part issues
    # its all-to-alls and aux-loss all-reduce (over the model's dp_group, often the wrappers' group too). A
    # bucket started from there would interleave with those collectives in a different order on each rank with
    # the threads driver (gloo pairs collectives of a group by issue order: a mismatch or a hang), and in the
    # middle of the forward with the steps driver. The pair's backward is never the step's last microbatch (the
    # forward part's microbatch is still to come), so its contributions must only accumulate: the pair runs
    # inside the wrapper's no_sync(), and every bucket starts later, on the calling thread, from the hooks of
    # the last microbatch's B / W.
    sync_off = module.no_sync() if _is_data_parallel(module) else contextlib.nullcontext()
    finished = {"backward": True}
    try:
        with sync_off:
            if driver == "steps":
                return run_pair_in_steps(module, x, y, dy, thread_stats)
            return _run_threads(module, x, y, dy, timeout, thread_stats, baton, finished)
    finally:
        if finished["backward"]:  # a backward thread still running keeps reading the flags
            for name, m in layers.items():
                m.wgrad_in_dispatch, m.compute_baton = before[name]


def _run_threads(
    module: nn.Module,
    x: Any,
    y: torch.Tensor,
    dy: torch.Tensor | None,
    timeout: float | None,
    thread_stats: dict | None,
    baton: ComputeBaton | None,
    finished: dict[str, bool],
) -> Any:
    """The ``"threads"`` driver: ``module(x)``; ``finished["backward"]`` says whether the backward thread ended.

    The backward starts alone and the forward once the backward's first exchange is in flight (or the backward
    ended without one): the steps driver's order (Megatron-Core's combined 1F1B) for the start, so the forward's
    first dispatch is not left under the short loss and head backward only. After that the OS (or the baton)
    decides who computes.
    """
    errors: list[BaseException] = []
    backward_exchanging = threading.Event()

    def backward() -> None:
        if baton is not None:
            baton.acquire()  # the backward starts; the forward takes the baton at the backward's first wait
        probe = ThreadProbe(thread_stats, "backward")
        try:
            with torch.profiler.record_function("splitgrad.overlap.backward"):
                torch.autograd.backward(y, dy)
        except BaseException as exc:  # re-raised on the calling thread
            errors.append(exc)
        finally:
            backward_exchanging.set()
            probe.stop()
            if baton is not None:
                baton.release()

    # Every all-to-all node of the backward signals while its exchange is in flight (only the first one matters).
    bound = bind_backward_exchanges(y, backward_exchanging.set)
    thread = threading.Thread(target=backward, name="splitgrad-overlap-backward", daemon=True)
    thread.start()
    probe = ThreadProbe(thread_stats, "forward")
    try:
        # Bounded: past ``timeout`` the forward starts anyway and the join below reports the stuck backward.
        backward_exchanging.wait(timeout)
        if baton is not None:
            baton.acquire()
        with torch.profiler.record_function("splitgrad.overlap.forward"):
            out = module(x)
    finally:
        probe.stop()
        if baton is not None:
            baton.release()  # a no-op when the forward failed before taking it
        thread.join(timeout)
        finished["backward"] = not thread.is_alive()
        if finished["backward"]:
            for node in bound:
                node.advance_pair = None
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


def _is_data_parallel(module: nn.Module) -> bool:
    """A splitgrad data-parallel wrapper (``DistributedDataParallel``, ``ExpertDataParallel``): the same duck
    test as the pipeline runtime's."""
    return callable(getattr(module, "no_sync", None)) and callable(getattr(module, "finish_grad_sync", None))


class OverlappedMoEStage(nn.Module):
    """``module`` with an ``overlapped_forward_backward(x, y, dy)`` method (what the pipeline runtime calls for an
    overlapped ``F+B`` action, see ``docs/pipeline_runtime.md``). Shapes: as ``module``.

    Keywords: as :func:`overlapped_forward_backward` (``driver``, ``timeout``, ``wgrad_in_dispatch``,
    ``exclusive_compute``), checked here.
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        driver: str = "steps",
        timeout: float | None = 600.0,
        wgrad_in_dispatch: bool | None = True,
        exclusive_compute: bool = False,
    ) -> None:
        super().__init__()
        if driver not in DRIVERS:
            raise ValueError(f"OverlappedMoEStage: driver must be one of {DRIVERS}, got {driver=}")
        if exclusive_compute and driver != "threads":
            raise ValueError(
                f"OverlappedMoEStage: exclusive_compute=True applies to driver='threads' only, got {driver=}"
            )
        self.module = module
        self.driver = driver
        self.timeout = timeout
        self.wgrad_in_dispatch = wgrad_in_dispatch
        self.exclusive_compute = exclusive_compute

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def forward_steps(self, *args: Any, **kwargs: Any) -> Steps:
        """:meth:`forward` as steps: the module's (see :mod:`splitgrad.core.steps`)."""
        return (yield from child_steps(self.module, *args, **kwargs))

    def overlapped_forward_backward(self, x: Any, y: torch.Tensor, dy: torch.Tensor | None = None) -> Any:
        """``self(x)`` while ``torch.autograd.backward(y, dy)`` runs (see :func:`overlapped_forward_backward`)."""
        return overlapped_forward_backward(
            self.module,
            x,
            y,
            dy,
            driver=self.driver,
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
