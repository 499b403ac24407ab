"""A split layer splitgrad does not ship, written with public names only: a token embedding with deferred wgrad.

``SplitEmbedding`` is ``torch.nn.Embedding`` (same parameter, init and state_dict key) whose weight gradient —
a scatter-add of the output gradient into the looked-up rows — can be deferred to ``backward_dw()``, added
straight into ``weight.main_grad`` (a data-parallel wrapper's buffer), or both, exactly like
``splitgrad.Linear``. It uses the extension points of :class:`splitgrad.SplitModule` (``wgrad_parameters``,
``init_split``, ``apply_function``, ``splits_wgrad``, ``hand_over_wgrad``) and
:func:`splitgrad.core.split_backward`; the library's conformance suite (``tests/conformance``) runs the whole
contract over it, and ``tests/core/test_custom_split_layer.py`` runs it inside
``splitgrad.parallel.DistributedDataParallel`` and the pipeline runtime.

Run ``python examples/custom_split_layer.py``: it checks the deferred gradient against plain
``torch.nn.Embedding`` and prints the difference (0).
"""

from __future__ import annotations

import torch
from torch import nn

import splitgrad
from splitgrad.core import SplitModule, split_backward
from splitgrad.functional.wgrad import accumulate_grad, check_targets, require_main_grad

__all__ = ["SplitEmbedding", "embedding_wgrad"]


def embedding_wgrad(ids: torch.Tensor, dy: torch.Tensor, num_embeddings: int) -> torch.Tensor:
    """``dW`` of ``y = W[ids]``: ``ids: (tokens,)``, ``dy: (tokens, dim)`` -> ``(num_embeddings, dim)``."""
    return dy.new_zeros(num_embeddings, dy.shape[1]).index_add_(0, ids, dy)


class _EmbeddingFunction(torch.autograd.Function):
    """``y = weight[ids]``; the weight gradient goes through the owner's :meth:`~SplitModule.hand_over_wgrad`."""

    @staticmethod
    def forward(ctx, ids: torch.Tensor, weight: torch.Tensor, owner: SplitEmbedding) -> torch.Tensor:  # type: ignore[override]
        # Decided at forward and kept: a switch flipped before backward cannot make autograd drop the gradient.
        ctx.owner, ctx.split, ctx.params = owner, owner.splits_wgrad(), (owner.weight,)
        ctx.save_for_backward(ids)
        return weight[ids]

    @staticmethod
    @split_backward
    def backward(ctx, dy: torch.Tensor):  # type: ignore[override]
        (ids,) = ctx.saved_tensors
        owner: SplitEmbedding = ctx.owner
        ids1, dy2 = ids.reshape(-1), dy.reshape(-1, dy.shape[-1])
        n = owner.num_embeddings

        def gradients(mask: tuple[bool, ...]) -> list[torch.Tensor | None]:
            return [embedding_wgrad(ids1, dy2, n) if mask[0] else None]

        def write(mask: tuple[bool, ...]) -> None:
            fused = owner.fuse_wgrad_accumulation
            # Check before writing anything: a task that fails stays owed and is retried whole.
            check_targets([(owner.weight, mask[0], "weight", fused)], owner=repr(owner))
            if not mask[0]:
                return
            if not fused:
                accumulate_grad(owner.weight, embedding_wgrad(ids1, dy2, n))
                return
            main_grad = require_main_grad(owner.weight, repr(owner), "weight")
            if getattr(owner.weight, "overwrite_main_grad", False):
                main_grad.zero_()
            # Scatter straight into the buffer: no weight-sized temporary (the point of fusing).
            main_grad.index_add_(0, ids1, dy2.to(main_grad.dtype))
            if hasattr(owner.weight, "grad_added_to_main_grad"):
                owner.weight.grad_added_to_main_grad = True

        (dweight,) = owner.hand_over_wgrad(
            ctx.params, ctx.needs_input_grad[1:2], split=ctx.split, gradients=gradients, write=write,
            saved=(ids1, dy2), create_graph=ctx.create_graph,
        )  # fmt: skip
        return None, dweight, None


class SplitEmbedding(SplitModule):
    """Drop-in ``torch.nn.Embedding`` (parameter ``weight``, N(0, 1) init) with a splittable backward.

    Args:
        num_embeddings: vocabulary size.
        embedding_dim: size of each embedding vector.
        delay_wgrad_compute: backward parks the weight gradient for :meth:`backward_dw`.
        fuse_wgrad_accumulation: add the weight gradient straight into ``weight.main_grad``.
        params_dtype: parameter dtype (default: torch's default dtype).
        device: parameter device.

    Shapes: ``ids: (...)`` integer -> ``(..., embedding_dim)``.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        delay_wgrad_compute: bool = False,
        fuse_wgrad_accumulation: bool = False,
        params_dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        if num_embeddings <= 0 or embedding_dim <= 0:
            raise ValueError(f"SplitEmbedding needs positive sizes, got {num_embeddings=} {embedding_dim=}")
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.weight = nn.Parameter(
            torch.randn(num_embeddings, embedding_dim, dtype=params_dtype, device=device)
        )
        self.init_split(
            delay_wgrad_compute=delay_wgrad_compute, fuse_wgrad_accumulation=fuse_wgrad_accumulation
        )

    def wgrad_parameters(self) -> list[nn.Parameter]:
        return [self.weight]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{self!r}: ids must be an integer tensor, got {ids.dtype}")
        return self.apply_function(_EmbeddingFunction, ids, self.weight, self)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, delay_wgrad_compute={self.need_backward_dw()}"


def main() -> None:
    torch.manual_seed(0)
    layer = SplitEmbedding(50, 16, delay_wgrad_compute=True)
    plain = nn.Embedding(50, 16)
    plain.weight.data.copy_(layer.weight)
    ids = torch.randint(0, 50, (4, 12))
    layer(ids).square().sum().backward()  # the weight gradient is parked
    assert layer.weight.grad is None and splitgrad.pending_wgrad(layer) == 1
    splitgrad.backward_dw(layer)  # ... and written now
    plain(ids).square().sum().backward()
    diff = (layer.weight.grad - plain.weight.grad).abs().max().item()
    print(f"SplitEmbedding deferred wgrad vs torch.nn.Embedding: max |difference| = {diff:.1e}")


if __name__ == "__main__":
    main()
