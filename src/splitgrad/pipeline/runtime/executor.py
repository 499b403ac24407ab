"""What one action computes on this rank's stages: forward, input gradient with W capture, W, hand-offs.

* ``F(s, i)``: run stage ``s`` on microbatch ``i``'s input (the batch for stage 0, else the activation received
  from ``s - 1`` or handed over locally, made a fresh leaf so its gradient can be read after ``B``); the last
  stage also computes ``loss_fn(output, target)``.
* ``B(s, i)``: backward from the stage output with the output gradient (the last stage: ``1 / n_microbatches``
  on its loss) inside :func:`splitgrad.capture_wgrad`. Autograd frees the graph; the input gradient goes to
  ``s - 1``; the weight-gradient work splitgrad layers (``delay_wgrad_compute=True``) deferred is parked in
  ``(s, i)``'s :class:`~splitgrad.WgradBundle`. Plain-autograd parameters (embeddings, norms, any ``torch.nn``
  layer) get their gradient here, which is just as correct.
* ``W(s, i)``: run exactly that bundle, whatever order the schedule puts ``W``\\ s in.
* ``BW(s, i)``: ``B`` then its bundle at once.

Nothing here communicates or knows about ranks; :class:`~splitgrad.pipeline.PipelineRuntime` drives it.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ...core import WgradBundle, capture_wgrad
from .recording import ActivationMeter

__all__ = ["StageExecutor"]

logger = logging.getLogger(__name__)

LossFn = Callable[[Any, Any], torch.Tensor]


class StageExecutor:
    """Runs ``F``/``B``/``W``/``BW`` of one rank's stages for one step at a time.

    Args:
        stages: ``{stage index: module}`` of this rank.
        n_stages: stages of the whole model (the last one computes the loss).
        n_microbatches: microbatches per step (the loss gradient is ``1 / n_microbatches``).
        loss_fn: ``loss_fn(last stage output, target) -> scalar``.
        meter: activation accounting, or None.
    """

    def __init__(
        self,
        stages: Mapping[int, nn.Module],
        *,
        n_stages: int,
        n_microbatches: int,
        loss_fn: LossFn,
        meter: ActivationMeter | None = None,
    ) -> None:
        self.stages = dict(stages)
        self.last_stage = n_stages - 1
        self.n_microbatches = n_microbatches
        self.loss_fn = loss_fn
        self.meter = meter
        self.begin(None, None)

    def begin_step(self, inputs: Any, targets: Any) -> None:
        """Start a step from the batch as a user passes it (see :func:`split_microbatches`): ``inputs`` are
        split where this rank holds stage 0, ``targets`` where it holds the last stage; ignored elsewhere."""
        m = self.n_microbatches
        self.begin(
            split_microbatches(inputs, m, "inputs") if 0 in self.stages else None,
            split_microbatches(targets, m, "targets") if self.last_stage in self.stages else None,
        )

    def begin(self, inputs: list[Any] | None, targets: list[Any] | None) -> None:
        """Start a step with per-microbatch inputs (first stage) and targets (last stage)."""
        self.inputs, self.targets = inputs, targets
        self._leaves: dict[tuple[int, int], torch.Tensor] = {}
        self._outputs: dict[tuple[int, int], torch.Tensor] = {}
        self._bundles: dict[tuple[int, int], WgradBundle] = {}
        self._local: dict[tuple[str, int, int], torch.Tensor] = {}
        #: Detached loss of every microbatch the last stage ran.
        self.losses: dict[int, torch.Tensor] = {}
        #: Deferred wgrad tasks run by ``W`` actions this step.
        self.w_tasks = 0
        if self.meter is not None:
            self.meter.reset()

    @property
    def peak_activation_bytes(self) -> int | None:
        """The step's activation peak in bytes (:class:`~.recording.ActivationMeter`); None when not tracked."""
        return None if self.meter is None else self.meter.peak

    def step_losses(self) -> list[torch.Tensor]:
        """Every microbatch's detached loss in order (empty unless this rank holds the last stage)."""
        if self.last_stage not in self.stages:
            return []
        return [self.losses[i] for i in range(self.n_microbatches)]

    def abort(self) -> None:
        """Give up the step: parked W work is discarded on purpose (no garbage-collection warning)."""
        for bundle in self._bundles.values():
            bundle.discard()
        self.begin(None, None)

    def check_complete(self, where: str) -> None:
        """Raise if the step left a ``W`` unrun or a forward never backwarded (gradients would be lost)."""
        no_w, no_b = sorted(self._bundles), sorted(self._outputs)
        if no_w or no_b:
            raise RuntimeError(
                f"{where}: the step ended with (stage, microbatch) {no_w} still owing their W (their weight "
                f"gradients would be lost) and {no_b} never backwarded"
            )

    # -- local hand-offs between stages on the same rank -------------------------------------------------

    def hand_over(self, kind: str, stage: int, mb: int, tensor: torch.Tensor) -> None:
        """Keep ``tensor`` (``kind`` ``"activation"`` or ``"gradient"`` produced by ``stage``) for a local stage."""
        self._local[(kind, stage, mb)] = tensor

    def _take(self, kind: str, stage: int, mb: int, received: torch.Tensor | None) -> torch.Tensor:
        if received is not None:
            return received
        try:
            return self._local.pop((kind, stage, mb))
        except KeyError:
            raise RuntimeError(
                f"no {kind} of stage {stage} microbatch {mb} was received or handed over"
            ) from None

    # -- the actions -------------------------------------------------------------------------------------

    def forward(self, stage: int, mb: int, received: torch.Tensor | None) -> torch.Tensor | None:
        """``F(stage, mb)``; returns the detached output for the next stage (None on the last stage)."""
        x = self._forward_input(stage, mb, received)
        with self._metered(stage, mb):
            y = self.stages[stage](x)
            return self._forward_done(stage, mb, x, y)

    def backward(
        self, stage: int, mb: int, received: torch.Tensor | None, *, run_weight: bool
    ) -> torch.Tensor | None:
        """``B`` (``run_weight=False``) or ``BW`` of ``(stage, mb)``; returns the input gradient (None on stage 0)."""
        x, y, grad = self._backward_operands(stage, mb, received)
        with capture_wgrad() as bundle:
            if y.requires_grad:
                torch.autograd.backward(y, grad)
        return self._backward_done(stage, mb, x, bundle, run_weight)

    def overlapped(
        self,
        forward: tuple[int, int, torch.Tensor | None],
        backward: tuple[int, int, torch.Tensor | None],
        *,
        run_weight: bool,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """An overlapped pair: ``F`` of ``forward = (stage, mb, received)`` and ``B``/``BW`` of ``backward``.

        When the forward stage's module has a callable ``overlapped_forward_backward(x, y, dy)`` it gets both
        parts at once: it must return ``module(x)`` and run ``torch.autograd.backward(y, dy)`` (``x``: the
        forward input, ``y``/``dy``: the backward part's output and its gradient, same shape), interleaving
        them as it likes (e.g. one part's all-to-all behind the other's GEMMs). Otherwise the forward runs,
        then the backward. Returns ``(forward output or None, input gradient or None)`` like :meth:`forward`
        and :meth:`backward`.
        """
        fs, fmb, freceived = forward
        bs, bmb, breceived = backward
        module = self.stages[fs]
        hook = getattr(module, "overlapped_forward_backward", None)
        if not callable(hook):
            out = self.forward(fs, fmb, freceived)
            return out, self.backward(bs, bmb, breceived, run_weight=run_weight)
        x = self._forward_input(fs, fmb, freceived)
        bx, y, grad = self._backward_operands(bs, bmb, breceived)
        with self._metered(fs, fmb), capture_wgrad() as bundle:
            out = hook(x, y, grad) if y.requires_grad else module(x)
            out = self._forward_done(fs, fmb, x, out)
        return out, self._backward_done(bs, bmb, bx, bundle, run_weight)

    def _metered(self, stage: int, mb: int) -> contextlib.AbstractContextManager[None]:
        """Count ``(stage, mb)``'s saved activations (the stage's parameters are weights, not activations)."""
        if self.meter is None:
            return contextlib.nullcontext()
        return self.meter.forward(stage, mb, exclude=tuple(self.stages[stage].parameters()))

    def _forward_input(self, stage: int, mb: int, received: torch.Tensor | None) -> torch.Tensor:
        if stage == 0:
            return self.inputs[mb]
        x = self._take("activation", stage - 1, mb, received)
        if not x.is_floating_point():
            raise ValueError(
                f"stage {stage - 1} must output a floating-point tensor (its gradient flows back), got dtype "
                f"{x.dtype} for microbatch {mb}"
            )
        return x.detach().requires_grad_()

    def _forward_done(self, stage: int, mb: int, x: torch.Tensor, y: Any) -> torch.Tensor | None:
        if not isinstance(y, torch.Tensor):
            raise TypeError(f"stage {stage} must return one tensor, got {type(y).__name__} (microbatch {mb})")
        if stage == self.last_stage:
            y = self.loss_fn(y, self.targets[mb])
            if not isinstance(y, torch.Tensor) or y.numel() != 1:
                raise ValueError(
                    f"loss_fn must return a scalar tensor, got {type(y).__name__} of shape "
                    f"{tuple(getattr(y, 'shape', ()))} for microbatch {mb}"
                )
            self.losses[mb] = y.detach().reshape(())
        self._leaves[(stage, mb)] = x
        self._outputs[(stage, mb)] = y
        return None if stage == self.last_stage else y.detach()

    def _backward_operands(
        self, stage: int, mb: int, received: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x = self._leaves.pop((stage, mb))
        y = self._outputs.pop((stage, mb))
        if stage == self.last_stage:
            grad = torch.full_like(y, 1.0 / self.n_microbatches)
        else:
            grad = self._take("gradient", stage + 1, mb, received)
            if grad.shape != y.shape:
                raise ValueError(
                    f"stage {stage} microbatch {mb}: output gradient of shape {tuple(grad.shape)} for an output of "
                    f"shape {tuple(y.shape)}"
                )
        return x, y, grad

    def _backward_done(
        self, stage: int, mb: int, x: torch.Tensor, bundle: WgradBundle, run_weight: bool
    ) -> torch.Tensor | None:
        if run_weight:
            self._run_bundle(stage, mb, bundle)
        else:
            self._bundles[(stage, mb)] = bundle
            if self.meter is not None:
                self.meter.hold(stage, mb, bundle.saved_bytes())
        if stage == 0:
            return None
        return x.grad if x.grad is not None else torch.zeros_like(x)

    def weight(self, stage: int, mb: int) -> None:
        """``W(stage, mb)``: run the bundle its ``B`` parked."""
        bundle = self._bundles.pop((stage, mb), None)
        if bundle is None:
            raise RuntimeError(f"W of stage {stage} microbatch {mb} has no parked work: its B has not run")
        self.w_tasks += self._run_bundle(stage, mb, bundle)

    def _run_bundle(self, stage: int, mb: int, bundle: WgradBundle) -> int:
        ran = bundle.run()  # WgradTask.run computes under no_grad itself
        if self.meter is not None:
            self.meter.release(stage, mb)
        return ran


def split_microbatches(value: Any, n_microbatches: int, what: str) -> list[Any]:
    """``value`` as ``n_microbatches`` pieces: a tensor split along dim 0, or a sequence of that length."""
    if value is None:
        raise ValueError(f"PipelineRuntime.step: {what} are required on this rank")
    if isinstance(value, torch.Tensor):
        if value.dim() == 0 or value.shape[0] % n_microbatches:
            raise ValueError(
                f"PipelineRuntime.step: {what} of shape {tuple(value.shape)} cannot be split into "
                f"{n_microbatches=} equal microbatches along dim 0"
            )
        return list(value.split(value.shape[0] // n_microbatches))
    if isinstance(value, Sequence) and len(value) == n_microbatches:
        return list(value)
    raise ValueError(
        f"PipelineRuntime.step: {what} must be a tensor or a sequence of {n_microbatches=} microbatches, got "
        f"{type(value).__name__}" + (f" of length {len(value)}" if isinstance(value, Sequence) else "")
    )
