"""Gradient reduction for expert parallelism: expert parameters over expert-DP, dense ones over DP.

Two :class:`~splitgrad.parallel.DistributedDataParallel` wrappers share one model, each managing one parameter
group through a :class:`ParameterGroup` view (its ``named_parameters`` lists only that group). Each keeps its own
buckets, ``main_grad`` buffers and process group, and registers the wgrad hooks only on the modules/ops whose
``get_backward_dw_params()`` include its parameters: the hooks that write an expert bucket start its
expert-data-parallel reduction, the dense modules' hooks (and autograd's post-accumulate-grad hooks) start the
dense buckets. The model runs once per step; both wrappers count the same forward graph.

Scaling: an expert's gradient on its owner already sums the contributions of the tokens of every rank of its
expert-parallel group, so summing it over the expert-data-parallel group covers all ``dp_size`` ranks; dividing
by ``dp_size`` (not by the expert-DP size) gives the data-parallel average, like the dense parameters
(Megatron-Core's ``expert_gradient_scaling_factor``).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist
from torch import nn

from ...core.steps import Steps, child_steps
from ..data import DistributedDataParallel

__all__ = ["ExpertDataParallel", "ParameterGroup", "is_expert_parameter"]

logger = logging.getLogger(__name__)


def is_expert_parameter(param: nn.Parameter) -> bool:
    """Whether ``param`` belongs to an expert sharded over an expert-parallel group (``param.expert_parallel``)."""
    return bool(getattr(param, "expert_parallel", False))


class ParameterGroup(nn.Module):
    """A view of ``model`` whose ``named_parameters()`` lists only ``params`` (for a per-group DDP wrapper).

    Args:
        model: the whole model (its modules, split-capable ones included, stay visible).
        params: the parameters of this group.
    """

    def __init__(self, model: nn.Module, params: list[nn.Parameter]) -> None:
        super().__init__()
        self.model = model
        self._keep = {id(p) for p in params}

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):  # type: ignore[override]
        for name, p in self.model.named_parameters(prefix, recurse, remove_duplicate):
            if id(p) in self._keep:
                yield name, p

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.model(*args, **kwargs)


class ExpertDataParallel(nn.Module):
    """Data parallelism for an expert-parallel model: two hook-driven reductions, one forward.

    Training loop (as :class:`~splitgrad.parallel.DistributedDataParallel`)::

        edp = ExpertDataParallel(model, dp_group=world, expert_dp_group=edp_group)
        edp.zero_grad_buffer(); lm_loss(edp(ids), targets).backward()
        splitgrad.backward_dw(edp)           # delayed wgrad: the expert buckets start from its hooks
        edp.finish_grad_sync(); opt.step()

    Args:
        module: the model; parameters with ``expert_parallel`` set (see
            :class:`~splitgrad.parallel.expert.ExpertParallelMoEMLP`) are expert parameters.
        dp_group: the dense parameters' data-parallel group (every rank with distinct tokens).
        expert_dp_group: the ranks holding replicas of the same experts (size ``dp_size / ep_size``).
        **ddp_kwargs: passed to both wrappers (``bucket_size``, ``grad_reduce_dtype``, ``timeout``, ...).
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        dp_group: dist.ProcessGroup,
        expert_dp_group: dist.ProcessGroup,
        **ddp_kwargs: Any,
    ) -> None:
        super().__init__()
        self.module = module
        trainable = [p for p in module.parameters() if p.requires_grad]
        expert = [p for p in trainable if is_expert_parameter(p)]
        dense = [p for p in trainable if not is_expert_parameter(p)]
        if not expert or not dense:
            raise ValueError(
                f"ExpertDataParallel: {type(module).__name__} needs expert and dense parameters, got "
                f"{len(expert)} expert and {len(dense)} dense; use DistributedDataParallel for a dense model"
            )
        dp_size, edp_size = dist.get_world_size(dp_group), dist.get_world_size(expert_dp_group)
        if dp_size % edp_size:
            raise ValueError(
                f"ExpertDataParallel: the expert-DP size must divide the DP size, got {dp_size=} {edp_size=}"
            )
        dense_ddp = DistributedDataParallel(
            ParameterGroup(module, dense), process_group=dp_group, **ddp_kwargs
        )
        expert_ddp = DistributedDataParallel(
            ParameterGroup(module, expert), process_group=expert_dp_group, **ddp_kwargs
        )
        expert_ddp.grad_divisor = dp_size
        # A tuple, not attributes: the wrappers must not register as submodules (parameters listed twice).
        self._wrappers = (dense_ddp, expert_ddp)

    @property
    def dense(self) -> DistributedDataParallel:
        """The wrapper of the dense parameters (data-parallel group)."""
        return self._wrappers[0]

    @property
    def expert(self) -> DistributedDataParallel:
        """The wrapper of the expert parameters (expert-data-parallel group)."""
        return self._wrappers[1]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the model once; both wrappers count the contributions its graph implies."""
        for ddp in self._wrappers:
            ddp.begin_forward()
        out = self.module(*args, **kwargs)
        for ddp in self._wrappers:
            ddp.expect_backward(out)
        return out

    def forward_steps(self, *args: Any, **kwargs: Any) -> Steps:
        """:meth:`forward` as steps: the model's (see :mod:`splitgrad.core.steps`)."""
        for ddp in self._wrappers:
            ddp.begin_forward()
        out = yield from child_steps(self.module, *args, **kwargs)
        for ddp in self._wrappers:
            ddp.expect_backward(out)
        return out

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate locally in both groups (every microbatch but the last)."""
        with self.dense.no_sync(), self.expert.no_sync():
            yield

    def finish_grad_sync(self) -> None:
        """Issue the reductions not started yet and wait for both groups'."""
        for ddp in self._wrappers:
            ddp.finish_grad_sync()

    def zero_grad_buffer(self) -> None:
        """Zero both groups' ``main_grad`` buffers and start a new step."""
        for ddp in self._wrappers:
            ddp.zero_grad_buffer()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Same as :meth:`zero_grad_buffer`."""
        del set_to_none
        self.zero_grad_buffer()

    def remove_hooks(self) -> None:
        """Detach both wrappers from the model."""
        for ddp in self._wrappers:
            ddp.remove_hooks()

    def close(self) -> None:
        """Close both wrappers (wait for reductions in flight, detach, release the groups); idempotent."""
        for ddp in self._wrappers:
            ddp.close()

    def __enter__(self) -> ExpertDataParallel:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
