"""The stage modules one pipeline rank runs: looked up by stage index, with their data-parallel wrappers.

:class:`LocalStages` owns what the runtime does with the modules as a whole (their parameters, zeroing their
gradients, closing their process-group holds); the handlers look up the data-parallel wrappers through it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn

from ...core import ensure_no_pending_wgrad
from ..ir.actions import Schedule

__all__ = ["LocalStages", "syncing_stages"]


class LocalStages:
    """This rank's stages of ``schedule``, from any form :class:`~splitgrad.pipeline.PipelineRuntime` accepts.

    Args:
        schedule: the schedule every rank runs.
        rank: this rank.
        stages: a mapping ``{stage: module}``, every stage of the model in order, or this rank's stages in
            ascending order.
        device: where this rank's received tensors go; default: its parameters' device (CPU without any).

    Raises:
        ValueError: the modules do not match the rank's stages. TypeError: a stage is not an ``nn.Module``.
    """

    __slots__ = ("device", "grad_sync", "modules")

    def __init__(
        self,
        schedule: Schedule,
        rank: int,
        stages: Mapping[int, nn.Module] | Sequence[nn.Module],
        device: torch.device | str | None = None,
    ) -> None:
        self.modules = _own_stages(schedule, rank, stages)
        """``{stage: module}`` of this rank."""
        self.grad_sync = syncing_stages(self.modules)
        """``{stage: module}`` of the data-parallel wrappers among them."""
        if device is None:
            params = [p for m in self.modules.values() for p in m.parameters()]
            device = params[0].device if params else torch.device("cpu")
        self.device = torch.device(device)

    def check_no_pending_wgrad(self, where: str) -> None:
        """Raise if a stage still owes deferred weight-gradient work (see :func:`splitgrad.ensure_no_pending_wgrad`)."""
        for s, module in self.modules.items():
            ensure_no_pending_wgrad(module, what=f"{where} (stage {s})")

    def parameters(self) -> list[nn.Parameter]:
        """The stages' parameters, each once."""
        seen: dict[int, nn.Parameter] = {}
        for module in self.modules.values():
            for p in module.parameters():
                seen.setdefault(id(p), p)
        return list(seen.values())

    def zero_grad(self) -> None:
        """``zero_grad_buffer()`` of data-parallel stages, else ``.grad = None``."""
        for module in self.modules.values():
            zero = getattr(module, "zero_grad_buffer", None)
            if callable(zero):
                zero()
            else:
                module.zero_grad(set_to_none=True)

    def close(self) -> None:
        """``close()`` every stage that has one (the data-parallel wrappers release their groups)."""
        for module in self.modules.values():
            close = getattr(module, "close", None)
            if callable(close):
                close()


def syncing_stages(modules: Mapping[int, nn.Module]) -> dict[int, nn.Module]:
    """The data-parallel wrappers among ``modules``: those that can hold back and finish their gradient
    reduction (``no_sync()`` and ``finish_grad_sync()``, e.g. :class:`splitgrad.parallel.DistributedDataParallel`)."""
    return {
        s: m
        for s, m in modules.items()
        if callable(getattr(m, "no_sync", None)) and callable(getattr(m, "finish_grad_sync", None))
    }


def _own_stages(
    schedule: Schedule, rank: int, stages: Mapping[int, nn.Module] | Sequence[nn.Module]
) -> dict[int, nn.Module]:
    """``{stage: module}`` of the stages ``schedule`` gives ``rank``, from any form
    :class:`~splitgrad.pipeline.PipelineRuntime` accepts (a mapping, all stages, or this rank's stages).

    Raises:
        ValueError: the modules do not match the rank's stages. TypeError: a stage is not an ``nn.Module``.
    """
    mine = schedule.stages_of(rank)
    if isinstance(stages, Mapping):
        owned = {int(k): v for k, v in stages.items()}
    elif len(stages) == schedule.n_stages:
        owned = {s: stages[s] for s in mine}
    elif len(stages) == len(mine):
        owned = dict(zip(mine, stages))
    else:
        raise ValueError(
            f"PipelineRuntime: got {len(stages)} stage modules; pass all {schedule.n_stages} stages of "
            f"the model or the {len(mine)} this rank holds (stages {list(mine)} of schedule "
            f"{schedule.name!r})"
        )
    if sorted(owned) != list(mine):
        raise ValueError(
            f"PipelineRuntime: pipeline rank {rank} runs stages {list(mine)} of schedule "
            f"{schedule.name!r}, got modules for stages {sorted(owned)}"
        )
    bad = [s for s, m in owned.items() if not isinstance(m, nn.Module)]
    if bad:
        raise TypeError(f"PipelineRuntime: stages {bad} are not nn.Modules")
    return owned
