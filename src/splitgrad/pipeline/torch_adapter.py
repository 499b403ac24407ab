"""Run splitgrad layers inside ``torch.distributed.pipelining``: PyTorch schedules, splitgrad's W step.

:func:`splitgrad_pipeline_stage` builds a :class:`torch.distributed.pipelining.PipelineStage` (a subclass,
:class:`SplitgradPipelineStage`) for a stage module made of splitgrad layers built with
``delay_wgrad_compute=True``. Every PyTorch schedule then runs on it unchanged (``Schedule1F1B``,
``ScheduleInterleavedZeroBubble``, ``ScheduleZBVZeroBubble``, ...), with the weight gradient computed by
splitgrad instead of by PyTorch's autograd-graph surgery.

Mechanism (torch 2.13, ``torch/distributed/pipelining/stage.py``):

* PyTorch's zero-bubble schedules issue ``I`` (input gradient) as ``stage.backward_one_chunk(mb,
  full_backward=False)`` and ``W`` as ``stage.backward_weight_one_chunk(mb)``; 1F1B/GPipe issue only ``B``,
  a full backward (``full_backward=True``).
* Without a ``dw_builder``, ``I`` calls ``stage_backward_input``: it walks the autograd graph to find the
  parameter subgraphs, runs ``autograd.grad`` w.r.t. the stage inputs with ``retain_graph=True`` (the whole
  graph stays alive until ``W``), then ``detach_()``\\ es the stage outputs — which raises *"Can't detach
  views in-place"* when an output is a view, as the output of ``F.linear`` on a 3-D ``(batch, seq, hidden)``
  input is. ``W`` later calls ``autograd.grad`` from the saved intermediates to the weights.
* With a ``dw_builder`` (what this adapter passes), *every* backward — ``I`` and ``B`` alike — is a plain
  ``torch.autograd.backward(stage_outputs, output_grads)`` (``stage_backward``): no graph walk, no
  ``retain_graph``, no in-place detach. Right after it, still inside ``backward_one_chunk(mb)``, PyTorch calls
  ``dw_builder()`` (no arguments) and stores the returned runner as ``stage.dw_runner[mb]``; for ``B`` it
  calls the runner at once, for ``I`` it pops and calls ``dw_runner[mb]`` in ``backward_weight_one_chunk(mb)``.
  So the runner is keyed by microbatch by PyTorch itself and W need not be FIFO. (In torch 2.13's
  zero-bubble schedules each stage's W's do come in its I order, checked for 2-4 ranks; nothing here
  relies on it.)

What this stage adds on top:

* ``backward_one_chunk(mb)`` runs PyTorch's backward inside :func:`splitgrad.capture_wgrad`: the splitgrad
  layers compute only dgrad there and park their wgrad tasks in that microbatch's
  :class:`~splitgrad.WgradBundle`; autograd frees the graph at once (only the wgrad operands — each layer's
  input and output gradient — stay alive until W).
* The ``dw_builder`` binds the runner to that bundle and microbatch; the runner runs the bundle (weights
  written, wgrad hooks fired). It checks that PyTorch calls it for the microbatch it was built for (inside
  ``backward_weight_one_chunk(mb)`` or the ``B`` that built it) and raises otherwise, so a future change of
  PyTorch's bookkeeping cannot silently swap microbatches.
* Owed W work stays visible: bundles count in ``WeightGradStore.captured``, so
  :func:`splitgrad.ensure_no_pending_wgrad` / :func:`splitgrad.guard_optimizer` see it, and
  :attr:`SplitgradPipelineStage.pending_microbatches` lists it. A new schedule step
  (``clear_runtime_states``) refuses to start while W work of the previous one is owed.
* Without static shapes (``input_args``/``output_args``), ``PipelineStage`` infers gradient shapes from a
  throw-away ``autograd.grad`` of the first microbatch before the first step; the wgrad that makes splitgrad
  layers park is dropped (that backward writes no parameter gradient in plain torch either). Wgrad tasks
  found in the layers' own stores at a backward (work from outside the schedule) are refused.
* Parameters of non-splitgrad layers in the stage still get their gradients from autograd during ``I``/``B``
  (correct, just not deferred); construction logs them.

Gradient scaling: PyTorch's schedules divide ``param.grad`` by ``n_microbatches`` after the last W
(``scale_grads=True``). That is exact here because the W runner writes ``.grad``. Layers built with
``fuse_wgrad_accumulation=True`` write ``main_grad`` instead, which PyTorch would not scale: the stage raises
then; build the schedule with ``scale_grads=False`` and scale the loss.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import PipelineStage

from ..core import WgradBundle, capture_wgrad, split_modules
from ..parallel.fsdp import fsdp_reduction_handle

__all__ = ["SplitgradPipelineStage", "splitgrad_pipeline_stage"]

logger = logging.getLogger(__name__)


class SplitgradPipelineStage(PipelineStage):
    """A ``PipelineStage`` whose ``W`` runs the splitgrad wgrad bundle parked by that microbatch's backward.

    Build it with :func:`splitgrad_pipeline_stage`; the constructor arguments are ``PipelineStage``'s minus
    ``dw_builder`` (owned by this class). See the module docstring for the mechanism.
    """

    def __init__(
        self,
        submodule: nn.Module,
        stage_index: int,
        num_stages: int,
        device: torch.device | str,
        *,
        input_args: torch.Tensor | tuple[torch.Tensor, ...] | None = None,
        output_args: torch.Tensor | tuple[torch.Tensor, ...] | None = None,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        _check_submodule(submodule, stage_index)
        self._split_layers = [m for _, m in split_modules(submodule)]
        # (microbatch, bundle) of the backward running right now; read by the dw_builder.
        self._open: tuple[int, WgradBundle] | None = None
        # Microbatch whose W PyTorch is running right now (inside backward_weight_one_chunk).
        self._w_running: int | None = None
        # Bundles whose backward ran but whose W did not, by microbatch.
        self._owed: dict[int, WgradBundle] = {}
        super().__init__(
            submodule,
            stage_index,
            num_stages,
            torch.device(device),
            input_args=input_args,
            output_args=output_args,
            group=group,
            dw_builder=self._build_dw_runner,
        )

    @property
    def pending_microbatches(self) -> tuple[int, ...]:
        """Microbatches whose backward parked weight-gradient work that no ``W`` has run yet."""
        return tuple(sorted(self._owed))

    def discard_pending_wgrad(self) -> int:
        """Give up the owed W work on purpose (e.g. after a failed step); returns how many tasks were dropped.

        Their weight gradients are lost; a following step can then start.
        """
        dropped = sum(bundle.discard() for bundle in self._owed.values())
        if self._owed:
            logger.warning(
                "%s discarded the W work of microbatches %s (%d task(s))",
                self.log_prefix,
                self.pending_microbatches,
                dropped,
            )
        self._owed.clear()
        return dropped

    # -- PyTorch's public stage API, wrapped -------------------------------------------------------------
    def backward_one_chunk(
        self, bwd_chunk_id: int, loss: Any = None, full_backward: bool = True, last_backward: bool = False
    ) -> None:
        """PyTorch's backward of microbatch ``bwd_chunk_id``, with splitgrad's wgrad parked in a bundle."""
        stray = sum(len(m.wgrad_store) for m in self._split_layers)
        if stray:
            raise RuntimeError(
                f"{self.log_prefix} its splitgrad layers hold {stray} wgrad task(s) from a backward run outside "
                "the schedule's backward_one_chunk (e.g. metadata inference of a torch version this adapter does "
                "not know); they would be run as some microbatch's W. Run or clear them first"
            )
        if bwd_chunk_id in self._owed:
            raise RuntimeError(
                f"{self.log_prefix} backward of microbatch {bwd_chunk_id} ran again before its W "
                f"({self.pending_microbatches=}); its weight gradient would be counted twice"
            )
        with capture_wgrad() as bundle:
            self._open = (bwd_chunk_id, bundle)
            try:
                super().backward_one_chunk(
                    bwd_chunk_id, loss=loss, full_backward=full_backward, last_backward=last_backward
                )
            except BaseException:
                # A failed backward produced no usable W: drop its partial work so nothing is owed twice.
                self._owed.pop(bwd_chunk_id, None)
                bundle.discard()
                raise
            finally:
                self._open = None
        if bundle.pending and bwd_chunk_id not in self._owed:
            # PyTorch ran the backward but never asked for a runner: the work would be orphaned.
            n = bundle.discard()
            raise RuntimeError(
                f"{self.log_prefix} backward of microbatch {bwd_chunk_id} parked {n} wgrad task(s) but "
                "PyTorch did not call dw_builder for it; this torch version's PipelineStage is not supported"
            )

    def backward_weight_one_chunk(self, bwd_chunk_id: int, last_backward: bool = False) -> None:
        """PyTorch's ``W`` of microbatch ``bwd_chunk_id``: runs the bundle its backward parked."""
        self._w_running = bwd_chunk_id
        try:
            super().backward_weight_one_chunk(bwd_chunk_id, last_backward=last_backward)
        finally:
            self._w_running = None

    def clear_runtime_states(self) -> None:
        """Called by the schedules at the start of each step; refuses to drop owed W work."""
        if self._owed:
            raise RuntimeError(
                f"{self.log_prefix} a new pipeline step started while the W of microbatches "
                f"{self.pending_microbatches} of the previous step never ran; their weight gradients would be "
                "lost (a schedule that issues I without W, or a failed step: call discard_pending_wgrad())"
            )
        super().clear_runtime_states()

    def perform_reduce_grad(self, grad_scale_factor: int) -> None:
        """PyTorch's ``REDUCE_GRAD`` (after the stage's last W): FSDP2 reduces the held deferred gradients too.

        With ``splitgrad.parallel.defer_fsdp_reduction`` on an FSDP2 stage the deferred gradients are held
        while PyTorch keeps gradient sync off; they are handed back to FSDP2 here, right before PyTorch calls
        FSDP2's ``post_backward``, so one reduce-scatter per group carries them with the autograd-written ones.
        """
        for handle in _fsdp_reductions(self.submod) or ():
            handle.release_to_fsdp()
        super().perform_reduce_grad(grad_scale_factor)

    def scale_grads(self, grad_scale_factor: int) -> None:
        """PyTorch's ``.grad`` scaling; refused when a fused layer keeps its weight gradient in ``main_grad``."""
        if grad_scale_factor != 1:
            fused = [
                name for name, m in split_modules(self.submod) if getattr(m, "fuse_wgrad_accumulation", False)
            ]
            if fused:
                raise RuntimeError(
                    f"{self.log_prefix} the schedule scales gradients by 1/{grad_scale_factor} but only "
                    f"`.grad` is scaled, and {fused} write their weight gradient into `main_grad` "
                    "(fuse_wgrad_accumulation=True); build the schedule with scale_grads=False and scale the loss"
                )
        super().scale_grads(grad_scale_factor)

    def _backward_metadata_inference(self, *args: Any, **kwargs: Any) -> Any:
        # Private torch hook, overridden on purpose: without static input/output shapes, PipelineStage infers
        # gradient shapes from a throw-away autograd.grad of the first microbatch. That grad writes no
        # parameter gradient, so the wgrad tasks it makes splitgrad park are dropped, not owed.
        with capture_wgrad() as bundle:
            result = super()._backward_metadata_inference(*args, **kwargs)
        bundle.discard()
        return result

    # -- the W runner ---------------------------------------------------------------------------------------
    def _build_dw_runner(self) -> Callable[[], None]:
        if self._open is None:
            raise RuntimeError(
                f"{self.log_prefix} dw_builder was called outside backward_one_chunk; "
                "SplitgradPipelineStage only supports PyTorch calling it right after a microbatch's backward"
            )
        microbatch, bundle = self._open
        self._owed[microbatch] = bundle

        def run_wgrad() -> None:
            self._run_wgrad(microbatch)

        return run_wgrad

    def _run_wgrad(self, microbatch: int) -> None:
        # B runs its runner inside the backward that built it; I's runner must run inside its own W.
        if self._w_running is not None:
            expected = self._w_running
        else:
            expected = self._open[0] if self._open is not None else None
        if expected != microbatch:
            raise RuntimeError(
                f"{self.log_prefix} the W runner of microbatch {microbatch} was called while PyTorch was running "
                f"the W of microbatch {expected}; refusing to write one microbatch's weight gradient for another"
            )
        bundle = self._owed.pop(microbatch, None)
        if bundle is None:
            raise RuntimeError(f"{self.log_prefix} the W of microbatch {microbatch} already ran")
        # The bundle's tasks compute under no_grad themselves (the schedule runs W with grad mode on).
        with torch.profiler.record_function(f"splitgrad.W:{self.stage_index}W{microbatch}"):
            bundle.run()


def splitgrad_pipeline_stage(
    module: nn.Module,
    stage_index: int,
    num_stages: int,
    device: torch.device | str,
    *,
    group: dist.ProcessGroup | None = None,
    input_args: torch.Tensor | tuple[torch.Tensor, ...] | None = None,
    output_args: torch.Tensor | tuple[torch.Tensor, ...] | None = None,
) -> SplitgradPipelineStage:
    """Wrap a stage module made of splitgrad layers as a ``torch.distributed.pipelining.PipelineStage``.

    Use the result exactly like a ``PipelineStage`` with any of PyTorch's schedules::

        stage = splitgrad_pipeline_stage(stage_module, stage_index, num_stages, device, group=pp_group)
        schedule = ScheduleInterleavedZeroBubble([stage, ...], n_microbatches, loss_fn=loss_fn)
        schedule.step(x, target=y)          # I: dgrad via splitgrad; W: splitgrad's wgrad bundle

    Args:
        module: the stage's layers; its splitgrad modules must have ``delay_wgrad_compute=True``.
        stage_index: this stage's index in ``0 .. num_stages - 1``.
        num_stages: stages in the whole pipeline.
        device: where the stage runs (``"cpu"``, ``"cuda:0"``, ...).
        group: the pipeline process group (default: the world group).
        input_args, output_args: optional example tensors for PyTorch's static shape metadata (otherwise it
            infers shapes from the first microbatch).

    Returns:
        The :class:`SplitgradPipelineStage`.

    Raises:
        ValueError: ``module`` holds no splitgrad layer, one of them does not delay its weight gradient, or it
            is wrapped in torch's DDP, or in FSDP2 without splitgrad.parallel.defer_fsdp_reduction.
    """
    return SplitgradPipelineStage(
        module, stage_index, num_stages, device, input_args=input_args, output_args=output_args, group=group
    )


def _fsdp_reductions(module: nn.Module) -> list | None:
    """The ``defer_fsdp_reduction`` handles of ``module``'s split layers; None unless every layer has one."""
    handles = [fsdp_reduction_handle(m) for _, m in split_modules(module)]
    if not handles or any(h is None for h in handles):
        return None
    return list({id(h): h for h in handles}.values())


def _check_submodule(module: nn.Module, stage_index: int) -> None:
    if isinstance(module, FSDPModule) and _fsdp_reductions(module) is not None:
        pass  # FSDP2 with splitgrad.parallel.defer_fsdp_reduction: reduced at REDUCE_GRAD (perform_reduce_grad)
    elif isinstance(module, FSDPModule):
        raise ValueError(
            f"stage {stage_index}: {type(module).__name__} is fully_shard-ed without "
            "splitgrad.parallel.defer_fsdp_reduction(module); call it after fully_shard so the deferred weight "
            "gradients reach FSDP2's reduction"
        )
    if isinstance(module, nn.parallel.DistributedDataParallel):
        raise ValueError(
            f"stage {stage_index}: {type(module).__name__} computes gradient reductions from autograd hooks, "
            "which never see splitgrad's deferred weight gradients; use splitgrad's data-parallel wrapper instead"
        )
    split = list(split_modules(module))
    if not split:
        raise ValueError(
            f"stage {stage_index}: {type(module).__name__} contains no splitgrad layer; use a plain "
            "torch.distributed.pipelining.PipelineStage"
        )
    immediate = [name for name, m in split if not m.need_backward_dw()]
    if immediate:
        raise ValueError(
            f"stage {stage_index}: splitgrad layers {immediate} were built without delay_wgrad_compute=True "
            "(or had it switched off), so their weight gradient would be computed in I instead of W; "
            "call splitgrad.set_delay_wgrad_compute(module, True)"
        )
    owned = {id(p) for _, m in split for p in m.get_backward_dw_params()}
    unsplit = [name for name, p in module.named_parameters() if p.requires_grad and id(p) not in owned]
    if unsplit:
        logger.info(
            "stage %d: parameters %s are not in splitgrad layers; autograd computes their gradients during the "
            "input-gradient backward (I/B), not in W",
            stage_index,
            unsplit,
        )
