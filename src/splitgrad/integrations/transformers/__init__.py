"""HuggingFace transformers v5: MoE experts with a deferred weight gradient (``pip install splitgrad[hf]``).

:func:`splitgrad.convert` calls into this package when transformers is loaded; use it directly only to convert
the experts alone. Nothing here imports transformers: a model's modules are recognised by the attributes
transformers' ``@use_experts_implementation`` decorator sets on every experts instance.

* :func:`convert_experts`: every decorated experts module of a model becomes split-capable in place
  (:mod:`~splitgrad.integrations.transformers.experts` says how, and why a class swap rather than a
  ``"splitgrad"`` entry in transformers' experts registry).
* :func:`hf_linears_to_leave`: the ``nn.Linear`` subclasses of transformers whose own ``forward`` is not a plain
  linear (routers such as ``PhimoeTopKRouter``, ``Llama4Router``), which ``convert`` leaves alone.
* :func:`hf_pipeline_stages`: a ``*ForCausalLM`` decoder cut into pipeline stages for
  :func:`splitgrad.pipeline.build_runtime`, each rebuilding the rotary embeddings and the causal mask
  (:mod:`~splitgrad.integrations.transformers.pipeline_stages`).
* :func:`shard_hf_experts`: every converted experts module sharded over an expert-parallel group
  (:class:`ExpertParallelExperts`: splitgrad's all-to-all dispatcher around this rank's experts).
* :func:`unsupported_experts`: experts modules outside the decorator (Llama4, DBRX, JetMoe, LongcatFlash, ...),
  which keep their weight gradients in autograd; ``convert`` names them in a warning.
"""

from __future__ import annotations

import logging

from torch import nn

from .expert_parallel import ExpertParallelExperts, shard_hf_experts
from .experts import SplitExperts, experts_forward, split_experts_class
from .pipeline_stages import HFDecoderStage, hf_pipeline_stages

__all__ = [
    "ExpertParallelExperts",
    "HFDecoderStage",
    "SplitExperts",
    "convert_experts",
    "experts_forward",
    "hf_linears_to_leave",
    "hf_pipeline_stages",
    "is_hf_experts",
    "is_transformers_module",
    "shard_hf_experts",
    "split_experts_class",
    "unsupported_experts",
]

logger = logging.getLogger(__name__)

#: What ``@use_experts_implementation`` sets on every instance of a decorated experts class.
DECORATOR_FLAGS = ("has_gate", "has_bias", "is_transposed", "is_concatenated", "has_post_expert_norm")
_FLOAT_DTYPES = ("torch.float16", "torch.bfloat16", "torch.float32", "torch.float64")


def is_transformers_module(module: nn.Module) -> bool:
    """Whether ``module``'s class is defined by the transformers package."""
    return type(module).__module__.split(".")[0] == "transformers"


def is_hf_experts(module: nn.Module) -> bool:
    """Whether ``module`` is an experts module of transformers' experts integration (decorated, not converted)."""
    return (
        not isinstance(module, SplitExperts)
        and all(hasattr(module, flag) for flag in DECORATOR_FLAGS)
        and hasattr(module, "num_experts")
        and callable(getattr(type(module), "_apply_gate", None))
    )


def _check_convertible(name: str, module: nn.Module) -> None:
    """Refuse an experts module whose parameters the split forward would not all handle."""
    cls = type(module).__name__
    up = "gate_up_proj" if module.has_gate else "up_proj"
    expected = {up, "down_proj"} | ({f"{up}_bias", "down_proj_bias"} if module.has_bias else set())
    own = {n: p for n, p in module.named_parameters(recurse=False)}
    norm = module.post_expert_norm if module.has_post_expert_norm else None
    extra = sorted(set(own) - expected)
    extra += [
        f"{child}.{n}"
        for child, m in module.named_children()
        if m is not norm
        for n, _ in m.named_parameters()
    ]
    if set(expected) - set(own) or extra:
        raise ValueError(
            f"convert: experts module {name!r} ({cls}) has parameters {sorted(own)} (+ submodules: "
            f"{[e for e in extra if '.' in e]}); the split experts forward handles exactly {sorted(expected)} "
            "(and a post_expert_norm). Leave it unconverted with convert(model, skip=[name])"
        )
    bad = {n: str(p.dtype) for n, p in own.items() if str(p.dtype) not in _FLOAT_DTYPES}
    if bad:
        raise ValueError(
            f"convert: experts module {name!r} ({cls}) holds quantized weights {bad}; only float16/bfloat16/"
            "float32/float64 experts are supported. Leave it unconverted with convert(model, skip=[name])"
        )
    for n in (up, "down_proj"):
        if own[n].dim() != 3 or own[n].shape[0] != module.num_experts:
            raise ValueError(
                f"convert: experts module {name!r} ({cls}): {n} has shape {tuple(own[n].shape)}, expected "
                f"({module.num_experts}, ., .) (num_experts={module.num_experts})"
            )


def convert_experts(
    model: nn.Module,
    *,
    delay_wgrad_compute: bool = True,
    fuse_wgrad_accumulation: bool = False,
    skip: frozenset[str] = frozenset(),
) -> list[str]:
    """Make every decorated HF experts module of ``model`` split-capable, in place (same object, same parameters).

    Args:
        model: a transformers model (or any module tree holding HF experts modules).
        delay_wgrad_compute: the experts defer their weight gradients to ``backward_dw``.
        fuse_wgrad_accumulation: the experts add their weight gradients into ``main_grad``
            (``(E, out, in)`` buffers shaped as the weights).
        skip: qualified names of modules to leave alone (with everything under them).

    Returns:
        The qualified names of the converted modules.

    Raises:
        ValueError: an experts module has parameters the split forward does not handle (named), or quantized
            weights. Nothing is converted then.
    """
    found = [
        (name, m)
        for name, m in model.named_modules()
        if is_hf_experts(m) and not any(name == s or name.startswith(f"{s}.") for s in skip)
    ]
    for name, module in found:
        _check_convertible(name, module)
    for _, module in found:
        module.__class__ = split_experts_class(type(module))
        module.init_split(
            delay_wgrad_compute=delay_wgrad_compute, fuse_wgrad_accumulation=fuse_wgrad_accumulation
        )
    logger.debug("convert: %d transformers experts module(s) made split-capable", len(found))
    return [name for name, _ in found]


def hf_linears_to_leave(model: nn.Module) -> dict[str, str]:
    """``{name: class name}`` of the ``nn.Linear`` subclasses defined by transformers that override ``forward``.

    Their forward is not ``x @ W.T + b`` (``PhimoeTopKRouter`` and ``Llama4Router`` route, ``DeepseekV4GroupedLinear``
    groups), so swapping them for a split Linear would change the model: routers and such stay as they are.
    """
    return {
        name: type(m).__name__
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear) and is_transformers_module(m) and type(m).forward is not nn.Linear.forward
    }


def unsupported_experts(model: nn.Module) -> dict[str, str]:
    """``{name: class name}`` of transformers experts modules outside the experts integration.

    Recognised as a transformers module whose class name contains ``Expert``, that holds weight matrices of
    its own (not ``nn.Linear`` children, which ``convert`` handles), and is not decorated: Llama4's
    ``Llama4TextExperts``, DBRX's ``DbrxExpertGLU``, JetMoe's ``JetMoeParallelExperts``, ``LongcatFlashExperts``.
    """
    return {
        name: type(m).__name__
        for name, m in model.named_modules()
        if is_transformers_module(m)
        and "Expert" in type(m).__name__
        and not is_hf_experts(m)
        and not isinstance(m, SplitExperts)
        and any(p.dim() >= 2 for p in m.parameters(recurse=False))
    }
