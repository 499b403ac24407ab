"""Running a split layer's autograd Function under ``torch.compile``.

A layer that defers (or fuses) its weight gradient parks a Python closure in its store from inside backward:
a side effect no compiled backward graph can hold (AOT autograd traces backward once, with fake tensors).
Dynamo used to find that out itself by speculating the Function's backward and failing on the store's lock
("Unsupported context manager ... lock"), which under ``fullgraph=True`` is an error that says nothing useful.
Instead the Function call is kept out of the graph on purpose: one graph break per split-mode layer call,
named with a reason that says what to do. Immediate-mode layers are traced normally (no break).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["COMPILE_BREAK_REASON", "apply_outside_compile"]

COMPILE_BREAK_REASON = (
    "splitgrad: a layer with delay_wgrad_compute=True or fuse_wgrad_accumulation=True parks/writes its weight "
    "gradient from Python inside backward, which a compiled graph cannot hold, so its Function runs eagerly "
    "(one graph break per such layer). With fullgraph=True compile the blocks between split layers, compile in "
    "immediate mode, or drop fullgraph (see docs/fsdp_compile.md)"
)


def apply_outside_compile(function: type[torch.autograd.Function], *args: object) -> object:
    """``function.apply(*args)``, never traced by dynamo (a graph break with :data:`COMPILE_BREAK_REASON`)."""
    if not torch.compiler.is_compiling():
        return function.apply(*args)
    return _disabled_apply()(function, *args)


def _disabled_apply() -> Callable[..., object]:
    # Built on first use (while dynamo traces), not at import: ``torch.compiler.disable`` imports all of
    # torch._dynamo (~1.7 s), which every process importing splitgrad (each spawned rank) would otherwise pay.
    # A dict, not functools.cache: dynamo refuses to trace into functools' cache wrapper, and the break it
    # reports would then not be splitgrad's.
    apply = _DISABLED.get("apply")
    if apply is None:

        def run(function: type[torch.autograd.Function], *args: object) -> object:
            return function.apply(*args)

        apply = _DISABLED["apply"] = torch.compiler.disable(run, reason=COMPILE_BREAK_REASON)
    return apply


#: The one lazily built disabled wrapper (a cache of an immutable function, filled once).
_DISABLED: dict[str, Callable[..., object]] = {}
