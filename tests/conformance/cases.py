"""The registry of split-capable cases the conformance suite runs its contract checks over.

A :class:`Case` says how to build one split-capable class in each mode, what to call it with, and the same
function written in plain torch (the float64 reference). The checks in :mod:`tests.conformance.checks` only
use the public contract (``backward_dw``, ``need_backward_dw``, ``get_backward_dw_params``,
``register_wgrad_accumulation_and_reduce_hooks``, ``skip_backward_post_hook``, ``main_grad``,
``capture_wgrad``), so any class honouring it can join.

Adding a class is one entry in :data:`CASES`::

    Case(
        name="custom_split_layer",
        make=lambda delay, fuse, dtype: MySplitLayer(8, 5, delay_wgrad_compute=delay,
                                                     fuse_wgrad_accumulation=fuse, params_dtype=dtype),
        x_shape=(6, 8),
        reference=lambda p, x: (F.linear(x, p["weight"], p["bias"]),),
        frozen=("bias",),
    )

``make(delay, fuse, dtype)`` builds the layer with deferred wgrad (``delay``) and/or accumulation into
``main_grad`` (``fuse``) and parameters of ``dtype``; the suite re-draws every parameter (seeded) so norms
are not the identity and biases not zero. ``reference(params, x)`` gets ``{name: float64 tensor}`` of the
layer's ``named_parameters()``. Leave ``modes`` out when the class supports all four, set ``call`` when it
takes more than ``x``, ``frozen`` to the parameter names to freeze in the frozen-parameter check (empty: the
check is skipped), ``graphed=True`` to run the case through ``splitgrad.make_graphed_callables`` (on the CPU
graph emulator, ``splitgrad.testing.CpuGraphBackend``), and ``bundles=False`` when its deferred work cannot go into ``capture_wgrad`` bundles.
``examples/custom_split_layer.py``, the extension example, is registered this way (``examples.SplitEmbedding``).
"""

from __future__ import annotations

import functools
import importlib.util
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

import splitgrad
from splitgrad import ops

__all__ = ["CASES", "MODES", "Case", "case_named"]

MODES = ("immediate", "delayed", "fused", "fused_delayed")
Params = dict[str, torch.Tensor]


def _call_x(subject: object, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    out = subject(x)
    return out if isinstance(out, tuple) else (out,)


@dataclass(frozen=True, kw_only=True)
class Case:
    """One split-capable class in one configuration."""

    name: str
    make: Callable[[bool, bool, torch.dtype], nn.Module]
    """``make(delay, fuse, dtype)`` -> the module (any initialisation; the suite re-draws parameters)."""
    x_shape: tuple[int, ...]
    reference: Callable[[Params, torch.Tensor], tuple[torch.Tensor, ...]]
    """Plain torch from ``{parameter name: tensor}`` and the input; returns the outputs as a tuple."""
    call: Callable[[object, torch.Tensor], tuple[torch.Tensor, ...]] = _call_x
    """Calls the module (or its graphed callable) on ``x``; returns the outputs as a tuple."""
    modes: tuple[str, ...] = MODES
    frozen: tuple[str, ...] = ()
    graphed: bool = False
    bundles: bool = True
    notes: str = field(default="", compare=False)

    def __repr__(self) -> str:
        return self.name


def case_named(name: str) -> Case:
    """The registered case called ``name``."""
    for case in CASES:
        if case.name == name:
            return case
    raise KeyError(f"no conformance case {name!r}; known: {[c.name for c in CASES]}")


# -- how each family spells the mode switches -------------------------------------------------------------
def _module_kw(delay: bool, fuse: bool, dtype: torch.dtype) -> dict:
    return {"delay_wgrad_compute": delay, "fuse_wgrad_accumulation": fuse, "params_dtype": dtype}


def _op_kw(delay: bool, fuse: bool, dtype: torch.dtype) -> dict:
    return {"delay_wgrad_compute": delay, "accumulate_into_main_grad": fuse, "dtype": dtype}


# -- plain-torch references -------------------------------------------------------------------------------
def _gelu_tanh(t: torch.Tensor) -> torch.Tensor:
    # The textbook formula, not F.gelu: the reference must not share the implementation under test.
    return 0.5 * t * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (t + 0.044715 * t**3)))


def _layer_norm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    mean = x.mean(-1, keepdim=True)
    var = (x - mean).pow(2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + 1e-5) * w + b


def _linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    y = x @ w.t()
    return y if b is None else y + b


def _grouped(splits: list[int], p: Params, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    # Either layout: per-group weight{g}/bias{g}, or one 3-D weight / 2-D bias indexed by group.
    def part(name: str, g: int) -> torch.Tensor | None:
        return p[name][g] if name in p else p.get(f"{name}{g}")

    x2 = x.reshape(-1, x.shape[-1])
    outs = [_linear(xg, part("weight", g), part("bias", g)) for g, xg in enumerate(x2.split(splits))]
    return (torch.cat(outs).view(*x.shape[:-1], -1),)


def _ln_linear_ref(p: Params, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    ln = _layer_norm(x, p["layer_norm_weight"], p["layer_norm_bias"])
    return (_linear(ln, p["weight"], p["bias"]),)


def _ln_mlp_ref(p: Params, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    ln = _layer_norm(x, p["layer_norm_weight"], p["layer_norm_bias"])
    hidden = _gelu_tanh(_linear(ln, p["fc1_weight"], p["fc1_bias"]))
    return (_linear(hidden, p["fc2_weight"], p["fc2_bias"]),)


def _ops_mlp_ref(p: Params, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    ln = _layer_norm(x, p["0.weight"], p["0.bias"])
    hidden = _gelu_tanh(_linear(ln, p["1.weight"], p["1.bias"]))
    return (_linear(hidden, p["3.weight"], p["3.bias"]),)


def _graphed_mlp_ref(p: Params, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    hidden = _gelu_tanh(_linear(x, p["0.weight"], p["0.bias"]))
    return (_linear(hidden, p["2.weight"], p["2.bias"]),)


def custom_split_layer_module():
    """``examples/custom_split_layer.py`` as a module (examples are scripts, not a package); registered in
    ``sys.modules`` so its classes pickle and deep-copy like any importable class."""
    name = "custom_split_layer"
    if name not in sys.modules:
        path = Path(__file__).parents[2] / "examples" / "custom_split_layer.py"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


# Token ids of the embedding case: repeats, so the scatter-add accumulates rows (the part that can go wrong).
EMBED_IDS = torch.tensor([3, 0, 3, 7, 1, 3])


def _embedding_call(subject: object, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    # The embedding's output scaled by a float input, so the suite's input-gradient checks have an input.
    return (subject(EMBED_IDS) * x,)


def _embedding(delay: bool, fuse: bool, dtype: torch.dtype) -> nn.Module:
    return custom_split_layer_module().SplitEmbedding(8, 5, **_module_kw(delay, fuse, dtype))


# -- builders ---------------------------------------------------------------------------------------------
SPLITS = [3, 5, 2]  # every group non-empty: a zero wgrad into main_grad would look like "not written"


def _add_returned_bias(subject: object, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    y, bias = subject(x)
    return (y + bias,)


def _grouped_call(subject: object, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return (subject(x, SPLITS),)


_SINGLE = {"single_grouped_weight": True, "single_grouped_bias": True}


def _grouped_case(
    name: str,
    make: Callable[[bool, bool, torch.dtype], nn.Module],
    *,
    frozen: tuple[str, ...],
    notes: str = "",
) -> Case:
    """A grouped linear (either class, either layout) called on ``(10, 8)`` rows split by :data:`SPLITS`."""
    reference = functools.partial(_grouped, SPLITS)
    return Case(
        name=name,
        make=make,
        x_shape=(10, 8),
        call=_grouped_call,
        reference=reference,
        frozen=frozen,
        notes=notes,
    )


def _ops_mlp(delay: bool, fuse: bool, dtype: torch.dtype) -> nn.Module:
    kw = _op_kw(delay, fuse, dtype)
    return ops.Sequential(
        ops.LayerNorm(8, dtype=dtype), ops.Linear(8, 12, **kw), ops.GELU(), ops.Linear(12, 5, **kw)
    )


def _graphed_module_mlp(delay: bool, fuse: bool, dtype: torch.dtype) -> nn.Module:
    kw = _module_kw(delay, fuse, dtype)
    return nn.Sequential(splitgrad.Linear(8, 12, **kw), nn.GELU("tanh"), splitgrad.Linear(12, 5, **kw))


def _graphed_ops_linear(delay: bool, fuse: bool, dtype: torch.dtype) -> nn.Module:
    return ops.Linear(8, 5, **_op_kw(delay, fuse, dtype))


CASES: list[Case] = [
    Case(
        name="Linear",
        make=lambda d, f, t: splitgrad.Linear(8, 5, **_module_kw(d, f, t)),
        x_shape=(2, 3, 8),
        reference=lambda p, x: (_linear(x, p["weight"], p["bias"]),),
        frozen=("bias",),
    ),
    Case(
        name="Linear(tp keywords, one rank, return_bias)",
        make=lambda d, f, t: splitgrad.Linear(
            8,
            5,
            tp_size=1,
            parallel_mode="row",
            sequence_parallel=True,
            return_bias=True,
            **_module_kw(d, f, t),
        ),
        x_shape=(2, 3, 8),
        call=_add_returned_bias,
        reference=lambda p, x: (_linear(x, p["weight"], p["bias"]),),
        notes="frozen: skipped, the weight is its only split parameter (the bias is returned and added by the "
        "caller, its gradient accumulated by autograd)",
    ),
    Case(
        name="LayerNormLinear",
        make=lambda d, f, t: splitgrad.LayerNormLinear(8, 5, **_module_kw(d, f, t)),
        x_shape=(6, 8),
        reference=_ln_linear_ref,
        frozen=("weight",),
    ),
    Case(
        name="LayerNormMLP",
        make=lambda d, f, t: splitgrad.LayerNormMLP(8, 12, **_module_kw(d, f, t)),
        x_shape=(6, 8),
        reference=_ln_mlp_ref,
        frozen=("fc1_weight", "layer_norm_bias"),
    ),
    _grouped_case(
        "GroupedLinear",
        lambda d, f, t: splitgrad.GroupedLinear(3, 8, 5, **_module_kw(d, f, t)),
        frozen=("weight1", "bias1"),
    ),
    Case(
        name="ops.BasicLinear",
        make=lambda d, f, t: ops.BasicLinear(8, 5, **_op_kw(d, f, t)),
        x_shape=(6, 8),
        reference=lambda p, x: (_linear(x, p["weight"], None),),
        notes="frozen: its only parameter is the weight (fully frozen layers are the modules' own tests)",
    ),
    Case(
        name="ops.Linear",
        make=lambda d, f, t: ops.Linear(8, 5, **_op_kw(d, f, t)),
        x_shape=(2, 3, 8),
        reference=lambda p, x: (_linear(x, p["weight"], p["bias"]),),
        frozen=("bias",),
    ),
    _grouped_case(
        "GroupedLinear(single_grouped_weight, single_grouped_bias)",
        lambda d, f, t: splitgrad.GroupedLinear(3, 8, 8, **_SINGLE, **_module_kw(d, f, t)),
        frozen=("bias",),
        notes="8 features: float32 runs torch's grouped_mm (16-byte strides), float64 the per-group loop",
    ),
    _grouped_case(
        "GroupedLinear(single_grouped_weight, per-group biases)",
        lambda d, f, t: splitgrad.GroupedLinear(3, 8, 5, single_grouped_weight=True, **_module_kw(d, f, t)),
        frozen=("weight",),
        notes="5 output features: float32 takes the loop too (20-byte rows)",
    ),
    _grouped_case(
        "ops.GroupedLinear",
        lambda d, f, t: ops.GroupedLinear(3, 8, 5, **_op_kw(d, f, t)),
        frozen=("weight1",),
    ),
    _grouped_case(
        "ops.GroupedLinear(single_grouped_weight, single_grouped_bias)",
        lambda d, f, t: ops.GroupedLinear(3, 8, 8, **_SINGLE, **_op_kw(d, f, t)),
        frozen=("bias",),
    ),
    Case(
        name="ops.Sequential",
        make=_ops_mlp,
        x_shape=(2, 3, 8),
        reference=_ops_mlp_ref,
        frozen=("1.weight",),
    ),
    Case(
        name="graphed.Sequential(Linear,GELU,Linear)",
        make=_graphed_module_mlp,
        x_shape=(6, 8),
        reference=_graphed_mlp_ref,
        frozen=("2.bias",),
        graphed=True,
        bundles=False,
        notes="one microbatch in flight per graph: bundles do not apply (graphs of several use order=...)",
    ),
    Case(
        name="graphed.ops.Linear",
        make=_graphed_ops_linear,
        x_shape=(6, 8),
        reference=lambda p, x: (_linear(x, p["weight"], p["bias"]),),
        frozen=("bias",),
        graphed=True,
        bundles=False,
    ),
    Case(
        name="examples.SplitEmbedding",
        make=_embedding,
        x_shape=(6, 5),
        call=_embedding_call,
        reference=lambda p, x: (p["weight"][EMBED_IDS] * x,),
        notes="the extension example (public names only); frozen: its only parameter is the weight",
    ),
]
