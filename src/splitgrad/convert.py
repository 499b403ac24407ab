"""``splitgrad.convert``: give an existing PyTorch model the split backward, in place.

Two kinds of layers are converted:

* **linears**: every ``torch.nn.Linear``, and every subclass that keeps ``nn.Linear.forward`` (torchtitan's
  ``Linear``, which only changes initialisation, is one), becomes a :class:`splitgrad.Linear` holding the same
  parameters. A subclass that overrides ``forward`` computes something else, so it is refused with an error
  naming it, unless the caller vouches for it (``types=``) or leaves it alone (``skip=``). A linear whose
  parent reads its ``.weight``/``.bias`` directly (``nn.MultiheadAttention``'s ``out_proj``, transformers'
  LongcatFlash router, Jamba's ``dt_proj``) is left alone: its gradient never passes through its ``forward``.
* **HuggingFace transformers v5 experts** (:mod:`splitgrad.integrations.transformers`): every module
  transformers' experts integration dispatches becomes split-capable in place; transformers' own
  ``nn.Linear`` subclasses that override ``forward`` (routers) are left alone, and experts outside the
  integration (Llama4, DBRX, ...) are named in a warning.
"""

from __future__ import annotations

import inspect
import logging
import re
from collections.abc import Iterable

import torch
from torch import nn

from .module.linear import Linear

__all__ = ["convert"]

logger = logging.getLogger(__name__)

# `self.<child>.weight` / `.bias` in a parent's code, unless only its dtype/device/shape is read.
_DIRECT_READ = (
    r"self\.{child}\.(weight|bias)\b(?!\s*\.\s*(dtype|device|shape|ndim|size|is_cuda|requires_grad)\b)"
)


def convert(
    model: nn.Module,
    *,
    delay_wgrad_compute: bool = True,
    fuse_wgrad_accumulation: bool = False,
    types: Iterable[type[nn.Linear]] = (),
    skip: Iterable[str] = (),
) -> nn.Module:
    """Make ``model``'s linears and HuggingFace experts split-capable, keeping every ``Parameter`` object.

    Works **in place**: each replacement takes over the original ``Parameter`` objects (same identity,
    values, names and ``state_dict`` keys), so an optimizer built before the call keeps working and nothing
    is copied; HF experts modules stay the same objects (their class becomes a split subclass of their own).
    The (mutated) model is returned for chaining; when ``model`` itself is a linear a new
    :class:`splitgrad.Linear` sharing its parameters is returned instead. A linear reachable under several
    names becomes one shared splitgrad Linear. A converted subclass becomes a plain :class:`splitgrad.Linear`:
    its extra methods and attributes do not come along.

    Args:
        model: any module tree.
        delay_wgrad_compute: the converted layers defer their weight gradient to ``backward_dw``.
        fuse_wgrad_accumulation: the converted layers add weight gradients into ``weight.main_grad``.
        types: ``nn.Linear`` subclasses that override ``forward`` but compute ``x @ W.T + b`` all the same
            (e.g. they only add logging): convert them too.
        skip: qualified module names to leave alone, with everything under them.

    Returns:
        ``model`` (converted in place), or the new layer when ``model`` is itself a linear.

    Raises:
        ValueError: a linear to convert has hooks registered on it (they would be silently dropped); an
            ``nn.Linear`` subclass overrides ``forward`` and is neither in ``types`` nor under ``skip`` (named,
            with its class); an HF experts module has parameters the split forward does not handle. Nothing
            is converted when it raises.
    """
    # Loaded on use: `import splitgrad` stays light (the integration itself never imports transformers).
    from .integrations import transformers as hf

    opted_in, skipped = tuple(types), frozenset(skip)
    bad = [t for t in opted_in if not (isinstance(t, type) and issubclass(t, nn.Linear))]
    if bad:
        raise ValueError(f"convert: types= takes nn.Linear subclasses, got {bad}")
    converted: dict[int, Linear] = {}

    def swap(name: str, linear: nn.Linear) -> Linear:
        if id(linear) not in converted:
            converted[id(linear)] = _split_linear(name, linear, delay_wgrad_compute, fuse_wgrad_accumulation)
        return converted[id(linear)]

    if isinstance(model, nn.Linear):
        _refuse_overriding({"<root>": model}, opted_in)
        _refuse_hooks("<root>", model)
        return swap("<root>", model)
    routers = hf.hf_linears_to_leave(model)
    targets, refused, sources = [], {}, {}
    # Collect first, then mutate: never change a module tree while iterating over it.
    for parent_name, parent in model.named_modules(remove_duplicate=False):
        for child_name, child in parent.named_children():
            name = f"{parent_name}.{child_name}".lstrip(".")
            if not isinstance(child, nn.Linear) or _under(name, skipped):
                continue
            if name in routers:
                logger.info(
                    "convert: left %s (%s, transformers' own forward) unconverted", name, routers[name]
                )
            elif _reads_directly(parent, child_name, sources):
                logger.info(
                    "convert: left %s unconverted: %s reads its parameters directly",
                    name,
                    type(parent).__name__,
                )
            elif _overrides_forward(child, opted_in):
                refused[name] = child
            else:
                _refuse_hooks(name, child)
                targets.append((parent, child_name, name, child))
    _refuse_overriding(refused, opted_in)
    experts = hf.convert_experts(
        model,
        delay_wgrad_compute=delay_wgrad_compute,
        fuse_wgrad_accumulation=fuse_wgrad_accumulation,
        skip=skipped,
    )
    for parent, child_name, name, child in targets:
        setattr(parent, child_name, swap(name, child))
    left = {n: c for n, c in hf.unsupported_experts(model).items() if not _under(n, skipped)}
    if left:
        logger.warning(
            "convert: %d experts module(s) outside transformers' experts integration keep their weight gradients "
            "in autograd (not deferred): %s",
            len(left),
            ", ".join(f"{n} ({c})" for n, c in left.items()),
        )
    logger.debug("convert: replaced %d linear(s), %d HF experts module(s)", len(converted), len(experts))
    return model


def _under(name: str, skipped: frozenset[str]) -> bool:
    return any(name == s or name.startswith(f"{s}.") for s in skipped)


def _overrides_forward(linear: nn.Linear, opted_in: tuple[type, ...]) -> bool:
    return type(linear).forward is not nn.Linear.forward and not isinstance(linear, opted_in)


def _refuse_overriding(found: dict[str, nn.Linear], opted_in: tuple[type, ...]) -> None:
    found = {n: m for n, m in found.items() if _overrides_forward(m, opted_in)}
    if found:
        listed = ", ".join(f"{n!r} ({type(m).__module__}.{type(m).__qualname__})" for n, m in found.items())
        classes = sorted({type(m).__name__ for m in found.values()})
        raise ValueError(
            f"convert: {listed} subclass nn.Linear and override forward, so a split Linear would compute "
            f"something else. If their forward is x @ W.T + b all the same, pass types=[{', '.join(classes)}]; "
            "otherwise leave them alone with skip=[<their names>]"
        )


def _reads_directly(parent: nn.Module, child: str, sources: dict[type, str]) -> bool:
    """Whether ``parent``'s own code (its classes below ``nn.Module``) reads ``self.<child>.weight``/``.bias``.

    Such a linear's gradient flows through autograd, never through its ``forward``: splitting it would mark a
    gradient the layer does not write as its own. Unreadable source (a class made in a REPL) counts as no.
    """
    pattern = re.compile(_DIRECT_READ.format(child=re.escape(child)))
    for cls in type(parent).__mro__:
        if cls in (nn.Module, object) or cls.__module__.startswith("splitgrad."):
            continue
        if cls not in sources:
            try:
                sources[cls] = inspect.getsource(cls)
            except (OSError, TypeError):
                sources[cls] = ""
        if pattern.search(sources[cls]):
            return True
    return False


def _refuse_hooks(name: str, linear: nn.Linear) -> None:
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


def _split_linear(name: str, linear: nn.Linear, delay: bool, fuse: bool) -> Linear:
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
