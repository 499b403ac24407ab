"""``splitgrad.convert``: give an existing PyTorch model the split backward by swapping its ``nn.Linear``s."""

from __future__ import annotations

import logging

import torch
from torch import nn

from .module.linear import Linear

__all__ = ["convert"]

logger = logging.getLogger(__name__)


def convert(
    model: nn.Module, *, delay_wgrad_compute: bool = True, fuse_wgrad_accumulation: bool = False
) -> nn.Module:
    """Replace every ``torch.nn.Linear`` in ``model`` by a :class:`splitgrad.Linear` holding the same parameters.

    Works **in place**: each replacement takes over the original ``Parameter`` objects (same identity,
    values, names and ``state_dict`` keys), so an optimizer built before the call keeps working and nothing
    is copied. The (mutated) model is returned for chaining; when ``model`` itself is an ``nn.Linear`` a new
    :class:`splitgrad.Linear` sharing its parameters is returned instead (a module cannot change its own
    class in place). A Linear reachable under several names becomes one shared splitgrad Linear.

    Only modules whose type is exactly ``nn.Linear`` are converted. Subclasses are left alone and logged,
    because they may override ``forward`` or be read directly by their parent (``nn.MultiheadAttention``'s
    ``out_proj`` is used through its ``weight``, never called, so splitting it would mark a gradient that
    still flows through autograd as deferred).

    Args:
        model: any module tree.
        delay_wgrad_compute: the converted layers defer their weight gradient to ``backward_dw``.
        fuse_wgrad_accumulation: the converted layers add weight gradients into ``weight.main_grad``.

    Returns:
        ``model`` (converted in place), or the new layer when ``model`` is itself an ``nn.Linear``.

    Raises:
        ValueError: a Linear to convert has hooks registered on it (they would be silently dropped).
    """
    converted: dict[int, Linear] = {}

    def swap(name: str, linear: nn.Linear) -> Linear:
        if id(linear) not in converted:
            converted[id(linear)] = _split_linear(name, linear, delay_wgrad_compute, fuse_wgrad_accumulation)
        return converted[id(linear)]

    if type(model) is nn.Linear:
        return swap("<root>", model)
    # Collect first, then mutate: never change a module tree while iterating over it.
    targets = [
        (parent_name, parent, child_name, child)
        for parent_name, parent in model.named_modules(remove_duplicate=False)
        for child_name, child in parent.named_children()
        if type(child) is nn.Linear
    ]
    for parent_name, parent, child_name, child in targets:
        setattr(parent, child_name, swap(f"{parent_name}.{child_name}".lstrip("."), child))
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            logger.info(
                "convert: left %s (%s, a subclass of nn.Linear) unconverted", name, type(module).__name__
            )
    logger.debug("convert: replaced %d nn.Linear module(s)", len(converted))
    return model


def _split_linear(name: str, linear: nn.Linear, delay: bool, fuse: bool) -> Linear:
    hooks = {
        "forward": linear._forward_hooks,
        "forward_pre": linear._forward_pre_hooks,
        "backward": linear._backward_hooks,
        "backward_pre": linear._backward_pre_hooks,
        "state_dict": linear._state_dict_hooks,
        "load_state_dict_pre": linear._load_state_dict_pre_hooks,
    }
    present = sorted(kind for kind, registered in hooks.items() if registered)
    if present:
        raise ValueError(
            f"convert: nn.Linear {name!r} has {present} hooks registered; they would be lost by the swap. "
            "Convert first, then register the hooks on the splitgrad.Linear."
        )
    # Built on the meta device so nothing is allocated or initialised for the parameters we then adopt.
    new = Linear(
        linear.in_features,
        linear.out_features,
        bias=linear.bias is not None,
        delay_wgrad_compute=delay,
        fuse_wgrad_accumulation=fuse,
        device=torch.device("meta"),
    )
    new.weight = linear.weight
    new.bias = linear.bias
    new.train(linear.training)
    # Re-applies skip_backward_post_hook, now to the adopted parameters.
    new.set_delay_wgrad_compute(delay)
    return new
