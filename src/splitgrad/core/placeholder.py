"""The placeholder ``.grad`` a layer shows a Megatron-style consumer after adding its weight gradient into
``main_grad`` itself (Transformer Engine's "dummy wgrad" convention), and when it is taken back.

Megatron-Core's ``DistributedDataParallel`` reads every parameter's gradient in one hook
(``_make_backward_post_hook``): with ``overlap_grad_reduce=True`` it asserts ``param.grad is not None``, it
adds ``param.grad`` into ``param.main_grad`` unless ``param.grad_added_to_main_grad`` is True (or
``param.zero_out_wgrad`` is set), sets ``param.grad = None`` and reports the parameter ready
(``register_grad_ready``). A layer that fuses its weight gradient into ``main_grad`` has no ``.grad`` to
show, so TE hands autograd a dummy weight-shaped gradient and sets ``grad_added_to_main_grad = True``.

splitgrad does the same, with three differences, each for a reason:

* **Only for consumers that read it**: a parameter carrying the ``grad_added_to_main_grad`` attribute (which
  Megatron's and splitgrad's data-parallel wrappers set), which the write set True. Without one, ``.grad``
  stays None as before.
* **Only while consumers look**: :meth:`~splitgrad.core.SplitModule.hand_over_wgrad` puts the placeholder in
  ``.grad`` right after the task's writes, before its hooks fire, and it is taken back (``.grad = None`` again, unless a consumer already cleared or replaced it) right
  after the owner's wgrad hooks fired for deferred work, or at the end of the running backward for work done
  inside it (Megatron's DDP without ``delay_wgrad_compute`` hooks the parameter's AccumulateGrad node, which
  runs after the layer's backward returned). Handing it to autograd instead, as TE does, would (a) leave it
  in ``.grad`` for every reader that does not clear it, and (b) tie it to the backward: a pipeline that runs
  two input-gradient steps before their two weight-gradient steps would show the second weight-gradient
  hook no gradient, which Megatron's assertion refuses.
* **No weight-sized memory at all**: it is a zero-stride view of a scalar zero (weight-shaped, one element
  of storage), not TE's cached weight-sized buffer. Adding it into ``main_grad`` (``zero_out_wgrad``) adds
  zeros, and writing into it in place raises instead of corrupting a buffer other layers share.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

__all__ = [
    "is_placeholder_grad",
    "placeholder_grad",
    "show_placeholder_grads",
    "take_back_placeholder_grads",
    "take_back_placeholder_grads_after_backward",
]

_MARK = "_splitgrad_placeholder_grad"


def placeholder_grad(param: torch.Tensor) -> torch.Tensor:
    """A zero gradient shaped like ``param`` (same dtype and device) holding one element of storage."""
    grad = torch.zeros((), dtype=param.dtype, device=param.device).expand(param.shape)
    setattr(grad, _MARK, True)
    return grad


def is_placeholder_grad(grad: torch.Tensor | None) -> bool:
    """Whether ``grad`` is a placeholder made by :func:`placeholder_grad`."""
    return grad is not None and getattr(grad, _MARK, False)


def show_placeholder_grads(params: Iterable[nn.Parameter | None]) -> None:
    """After a task's writes: a placeholder ``.grad`` on each parameter written into ``main_grad`` for a
    Megatron-style consumer, i.e. whose ``grad_added_to_main_grad`` the write set True and whose ``.grad``
    is None (a parameter written into ``.grad``, like a bias, already shows its gradient)."""
    for p in params:
        if p is not None and p.grad is None and getattr(p, "grad_added_to_main_grad", False):
            p.grad = placeholder_grad(p)


def take_back_placeholder_grads(params: Iterable[nn.Parameter | None]) -> None:
    """Set ``.grad = None`` on every parameter of ``params`` whose ``.grad`` is still a placeholder."""
    for p in params:
        if p is not None and is_placeholder_grad(p.grad):
            p.grad = None


def take_back_placeholder_grads_after_backward(params: Iterable[nn.Parameter | None]) -> None:
    """:func:`take_back_placeholder_grads` at the end of the running backward (now, outside one).

    Work written inside a backward (immediate fused mode) is read by consumers that hook the parameter's
    AccumulateGrad node, which runs after the layer's backward returned: the placeholder must outlive it.
    """
    held = [p for p in params if p is not None and is_placeholder_grad(p.grad)]
    if not held:
        return
    # Private engine call, on purpose: torch has no public "at the end of this backward" callback (FSDP2 and
    # torch DDP use this one). It raises outside a backward; then the consumers have had their turn.
    try:
        torch.autograd.Variable._execution_engine.queue_callback(lambda: take_back_placeholder_grads(held))
    except RuntimeError:
        take_back_placeholder_grads(held)
