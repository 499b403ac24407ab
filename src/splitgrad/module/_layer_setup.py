"""Constructor steps the TE-style modules share (``Linear``, ``LayerNormLinear``, ``LayerNormMLP``, ``GroupedLinear``).

Each step checks its arguments with the message every module has always given (tests match on it) and sets the
attributes the module's Functions and the tensor-parallel helpers read, so the modules agree by construction.
The modules call the steps in their own order: which error a call with several bad arguments reports first
stays what it was.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from ._tp_linear import SP_WGRAD_INPUTS

__all__ = [
    "init_norm_settings",
    "init_te_settings",
    "register_norm_parameters",
    "register_optional_parameter",
]


def init_te_settings(
    module: nn.Module,
    label: str,
    *,
    name: str | None,
    return_bias: bool,
    sp_wgrad_input: str,
    init_method: Callable[[torch.Tensor], object] | None,
    rng: tuple[Callable[[], object] | None, str | None],
) -> None:
    """Check ``sp_wgrad_input`` and set the TE keywords every single/two-linear module keeps.

    Sets ``name``, ``return_bias``, ``sp_wgrad_input``, ``tp_comm_overlap`` (True: the backward collectives
    overlap the GEMMs; False only to measure what the overlap hides), ``_init_method`` and ``_rng``
    (``(get_rng_state_tracker, rng_tracker_name)``, the arguments of :func:`rng_tracker_fork`).

    Raises:
        ValueError: ``sp_wgrad_input`` is not one of :data:`SP_WGRAD_INPUTS`.
    """
    if sp_wgrad_input not in SP_WGRAD_INPUTS:
        raise ValueError(f"{label}: sp_wgrad_input must be one of {SP_WGRAD_INPUTS}, got {sp_wgrad_input=}")
    module.name = name
    module.return_bias = bool(return_bias)
    module.sp_wgrad_input = sp_wgrad_input
    module.tp_comm_overlap = True
    module._init_method = init_method
    module._rng = rng


def init_norm_settings(
    module: nn.Module, label: str, *, normalization: str, eps: float, zero_centered_gamma: bool
) -> None:
    """Check ``eps`` and set the norm's ``eps``, ``normalization`` and ``zero_centered_gamma``.

    ``normalization`` is checked by the caller (``check_normalization``), before whatever else it checks.

    Raises:
        ValueError: ``eps < 0``.
    """
    if eps < 0:
        raise ValueError(f"{label}: eps must be >= 0, got {eps=}")
    module.eps = float(eps)
    module.normalization = normalization
    module.zero_centered_gamma = bool(zero_centered_gamma)


def register_optional_parameter(
    module: nn.Module, name: str, enabled: bool, shape: Sequence[int], factory: dict[str, Any]
) -> None:
    """Register an uninitialised ``name: shape`` parameter, or ``None`` under that name (as ``nn.Linear``)."""
    param = nn.Parameter(torch.empty(*shape, **factory)) if enabled else None
    module.register_parameter(name, param)


def register_norm_parameters(module: nn.Module, size: int, factory: dict[str, Any]) -> None:
    """Register ``layer_norm_weight: (size,)`` and ``layer_norm_bias: (size,)`` (None for RMSNorm), uninitialised.

    Reads ``module.normalization`` (set by :func:`init_norm_settings`).
    """
    module.layer_norm_weight = nn.Parameter(torch.empty(size, **factory))
    register_optional_parameter(
        module, "layer_norm_bias", module.normalization == "LayerNorm", (size,), factory
    )
