"""Transformer Engine's constructor keywords of ``Linear``/``LayerNormLinear``/``LayerNormMLP``, one table.

Every keyword TE's three layers take (TE at d0067d0, August 2026) is listed once with what splitgrad does with
it, so ported code either runs with TE's meaning or stops at construction with a ``ValueError`` that names the
keyword and says what to use instead — never a ``TypeError`` for a name TE accepts, never a silently ignored
request. ``docs/modules.md`` prints the same table and ``tests/modules/test_te_keywords.py`` holds the two
together.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

__all__ = [
    "DEFAULT_ONLY",
    "NO_EFFECT",
    "SUPPORTED",
    "TE_KEYWORDS",
    "TEKeyword",
    "refuse_unsupported_te_keywords",
    "rng_tracker_fork",
]

#: TE's meaning is implemented.
SUPPORTED = "supported"
#: Accepted with any value; in TE it only tunes something splitgrad does not have (documented per keyword).
NO_EFFECT = "no effect"
#: Accepted at TE's default (None / False); any other value is a ``ValueError`` saying what to use instead.
DEFAULT_ONLY = "default only"

_ALL = ("Linear", "LayerNormLinear", "LayerNormMLP")
_NORMED = ("LayerNormLinear", "LayerNormMLP")
_UB = (
    "userbuffers (TE's CUDA comm-GEMM overlap) do not exist in splitgrad; its backward already overlaps the "
    "torch.distributed collectives with the GEMMs (see docs/tensor_parallel.md), pass False"
)


@dataclass(frozen=True, slots=True)
class TEKeyword:
    """One TE constructor keyword and what splitgrad does with it."""

    name: str
    """The keyword, spelled as in TE."""
    modules: tuple[str, ...]
    """The layers (of :data:`_ALL`) whose TE signature has it."""
    status: str
    """:data:`SUPPORTED`, :data:`NO_EFFECT` or :data:`DEFAULT_ONLY`."""
    note: str
    """The meaning (supported), why it changes nothing (no effect), or what to use instead (default only)."""


TE_KEYWORDS: tuple[TEKeyword, ...] = (
    TEKeyword("in_features", ("Linear", "LayerNormLinear"), SUPPORTED, "the whole layer's input size"),
    TEKeyword("out_features", ("Linear", "LayerNormLinear"), SUPPORTED, "the whole layer's output size"),
    TEKeyword("hidden_size", ("LayerNormMLP",), SUPPORTED, "input and output size"),
    TEKeyword("ffn_hidden_size", ("LayerNormMLP",), SUPPORTED, "the whole inner size (sharded over TP)"),
    TEKeyword("bias", _ALL, SUPPORTED, "learn additive biases"),
    TEKeyword("eps", _NORMED, SUPPORTED, "the norm's epsilon"),
    TEKeyword("normalization", _NORMED, SUPPORTED, '"LayerNorm" or "RMSNorm"'),
    TEKeyword("zero_centered_gamma", _NORMED, SUPPORTED, "the norm's scale is 1 + weight"),
    TEKeyword(
        "activation",
        ("LayerNormMLP",),
        SUPPORTED,
        'gelu, relu, swiglu, geglu (TE\'s others, e.g. "qgelu", "srelu", "clamped_swiglu": ValueError)',
    ),
    TEKeyword(
        "activation_params",
        ("LayerNormMLP",),
        DEFAULT_ONLY,
        "TE uses it only for clamped_swiglu, which splitgrad does not have",
    ),
    TEKeyword("sequence_parallel", _ALL, SUPPORTED, "activations sharded on dim 0 outside the layer"),
    TEKeyword("tp_group", _ALL, SUPPORTED, "the tensor-parallel process group"),
    TEKeyword(
        "tp_size",
        _ALL,
        SUPPORTED,
        "checked against tp_group; > 1 without a group is a ValueError (no set_tensor_parallel_group)",
    ),
    TEKeyword(
        "parallel_mode", ("Linear", "LayerNormLinear"), SUPPORTED, '"column", "row" (Linear only) or None'
    ),
    TEKeyword(
        "set_parallel_mode",
        ("LayerNormMLP",),
        SUPPORTED,
        "fc1 column / fc2 row; False with a multi-rank tp_group (TE: sharded weights, no communication) is "
        "a ValueError",
    ),
    TEKeyword("return_bias", _ALL, SUPPORTED, "return (output, bias) without adding the bias"),
    TEKeyword(
        "init_method", _ALL, SUPPORTED, "init_method(weight) on the local weight shard (fc1 in the MLP)"
    ),
    TEKeyword(
        "output_layer_init_method",
        ("LayerNormMLP",),
        SUPPORTED,
        "init of the local fc2 weight (None: as without init_method)",
    ),
    TEKeyword(
        "get_rng_state_tracker",
        _ALL,
        SUPPORTED,
        "initialise the parameters inside get_rng_state_tracker().fork() (Megatron's CudaRNGStatesTracker shape)",
    ),
    TEKeyword("rng_tracker_name", ("Linear",), SUPPORTED, "the name passed to fork()"),
    TEKeyword("params_dtype", _ALL, SUPPORTED, "parameter dtype"),
    TEKeyword("device", _ALL, SUPPORTED, "parameter device (splitgrad's default: torch's, not cuda)"),
    TEKeyword("fuse_wgrad_accumulation", _ALL, SUPPORTED, "add the weight gradient into weight.main_grad"),
    TEKeyword("delay_wgrad_compute", _ALL, SUPPORTED, "park the weight gradient for backward_dw()"),
    TEKeyword("name", _ALL, SUPPORTED, "the module's name, shown in its repr and error messages"),
    TEKeyword("return_layernorm_output", ("LayerNormLinear",), SUPPORTED, "also return the norm's output"),
    TEKeyword(
        "return_layernorm_output",
        ("LayerNormMLP",),
        DEFAULT_ONLY,
        "use LayerNormLinear, or a separate norm before LayerNormMLP",
    ),
    TEKeyword(
        "return_layernorm_output_gathered",
        ("LayerNormLinear",),
        SUPPORTED,
        "under sequence parallelism the returned norm output is all-gathered (its gradient reduce-scattered)",
    ),
    TEKeyword(
        "return_layernorm_output_gathered",
        ("LayerNormMLP",),
        DEFAULT_ONLY,
        "LayerNormMLP does not return its norm output",
    ),
    TEKeyword(
        "parameters_split",
        ("Linear", "LayerNormLinear"),
        DEFAULT_ONLY,
        "use one splitgrad layer per part, or slice the one weight (splitgrad keeps one weight parameter)",
    ),
    TEKeyword(
        "symmetric_ar_type",
        _ALL,
        DEFAULT_ONLY,
        "splitgrad's all-reduce is torch.distributed's standard one (no symmetric-memory variants)",
    ),
    TEKeyword(
        "save_original_input",
        ("Linear",),
        NO_EFFECT,
        "TE's choice between the original and the quantized input; splitgrad does not quantize and always "
        "saves the original input",
    ),
    TEKeyword(
        "checkpoint",
        ("LayerNormMLP",),
        DEFAULT_ONLY,
        "wrap the module in torch.utils.checkpoint (splitgrad has no selective recompute inside the MLP)",
    ),
    TEKeyword("seq_length", ("LayerNormMLP",), NO_EFFECT, "TE uses it only to warm up JIT-fused kernels"),
    TEKeyword(
        "micro_batch_size", ("LayerNormMLP",), NO_EFFECT, "TE uses it only to warm up JIT-fused kernels"
    ),
    TEKeyword("ub_name", ("Linear", "LayerNormLinear"), NO_EFFECT, "names a userbuffer; none is used"),
    *(
        TEKeyword(ub, _ALL, DEFAULT_ONLY, _UB)
        for ub in ("ub_overlap_ag", "ub_overlap_rs", "ub_overlap_rs_dgrad", "ub_bulk_dgrad", "ub_bulk_wgrad")
    ),
)


def refuse_unsupported_te_keywords(module: str, owner: str, values: Mapping[str, object]) -> None:
    """Raise ``ValueError`` for a :data:`DEFAULT_ONLY` keyword of ``module`` given a non-default value.

    Args:
        module: ``"Linear"``, ``"LayerNormLinear"`` or ``"LayerNormMLP"``.
        owner: the layer as error messages name it.
        values: the constructor's values of (at least) every default-only keyword of ``module``.

    Raises:
        ValueError: naming the keyword, its value and what to use instead.
    """
    for kw in TE_KEYWORDS:
        if kw.status != DEFAULT_ONLY or module not in kw.modules:
            continue
        value = values[kw.name]
        # TE's default for each of these is None or False.
        if value is not None and value is not False:
            raise ValueError(f"{owner}: {kw.name}={value!r} is not supported: {kw.note}")


@contextlib.contextmanager
def rng_tracker_fork(
    get_rng_state_tracker: Callable[[], object] | None, rng_tracker_name: str | None = None
) -> Iterator[None]:
    """Run the block under ``get_rng_state_tracker().fork(rng_tracker_name)`` (TE's parameter init).

    Megatron's tracker keeps one named RNG state per purpose (the model-parallel one is seeded differently on
    every TP rank so that weight shards differ); ``fork`` swaps it in and restores the default generator
    after, so initialising under it neither depends on nor advances the default stream. None: no fork.
    """
    if get_rng_state_tracker is None:
        yield
        return
    tracker = get_rng_state_tracker()
    fork = tracker.fork(rng_tracker_name) if rng_tracker_name else tracker.fork()
    with fork:
        yield
