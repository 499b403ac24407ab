"""Cutting a :class:`~splitgrad.models.GPT` / :class:`~splitgrad.models.MoEGPT` into pipeline stages.

Stage contract (what the pipeline runtime may rely on):

* The stages are contiguous runs of ``[embed, *blocks, head]``: stage 0 holds the embeddings, the last stage
  holds the final norm and the LM head, every stage holds at least one piece.
* ``stage(x)`` takes exactly one tensor and returns exactly one tensor:

  - first stage consumes token ids ``(batch, seq)`` int64; every other stage consumes the previous stage's
    output ``(batch, seq, hidden)`` in the parameter dtype (``(seq / tp, batch, hidden)``, this rank's
    sequence block, with ``config.sequence_parallel`` and ``tp_size > 1``);
  - the last stage produces logits ``(batch, seq, vocab)`` for :func:`~splitgrad.models.lm_loss`; every other
    stage produces ``(batch, seq, hidden)``.

* Stages *share* the model's modules (no copies): training the stages trains the model, and a stage's
  ``named_parameters()`` are the model's own qualified names (blocks keep their global index).
* MoE load-balancing losses need no extra tensor between stages: each MoE layer adds its aux-loss gradient
  during its own backward (:class:`~splitgrad.models.moe.AuxLossInjector`). Set the microbatch weight with
  :func:`~splitgrad.models.set_aux_loss_scale` when microbatch losses are averaged.
* Tied embeddings cannot be cut (the weight would sit on the first and the last stage): build pipelined
  models with ``tie_embeddings=False`` (the default).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
from torch import nn

from ..core.steps import Steps, child_steps
from .gpt import GPT

__all__ = ["StageModule", "split_into_stages", "stage_layer_counts"]

logger = logging.getLogger(__name__)


class StageModule(nn.Module):
    """One contiguous slice of a GPT: optional embedding, some blocks, optional head.

    Attributes:
        index: this stage's position (0-based); n_stages: how many stages the model was cut into.
        layers: the global indices of the blocks it holds.
    """

    def __init__(self, model: GPT, index: int, n_stages: int, layers: range) -> None:
        super().__init__()
        self.index = index
        self.n_stages = n_stages
        self.layers = layers
        self.hidden_size = model.config.hidden_size
        self.vocab_size = model.config.vocab_size
        #: Ranks the activations between stages are sharded over on the sequence (1: not sharded).
        self.sequence_shards = model.config.tp_size if model.config.sequence_parallel else 1
        self.tied = model.config.tie_embeddings
        self.embed = model.embed if self.is_first else None
        # Keyed by the global index so parameter names match the model's ("blocks.3.attn.qkv.weight").
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in layers})
        self.head = model.head if self.is_last else None

    @property
    def dtype(self) -> torch.dtype:
        """The parameter (hence activation) dtype, read live so ``stage.to(dtype)`` is reflected."""
        return next(self.parameters()).dtype

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.n_stages - 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """First stage: ids ``(batch, seq)`` int64; others: ``(batch, seq, hidden)``. Returns ``(batch, seq,
        hidden)``, or logits ``(batch, seq, vocab)`` on the last stage."""
        x = self._enter(x)
        for block in self.blocks.values():
            x = block(x)
        return self._leave(x)

    def forward_steps(self, x: torch.Tensor) -> Steps:
        """:meth:`forward` as steps: each block's (see :mod:`splitgrad.core.steps`; a twin of :meth:`forward`,
        not its driver, so the plain forward stays free of generators for ``torch.compile``)."""
        x = self._enter(x)
        for block in self.blocks.values():
            x = yield from child_steps(block, x)
        return self._leave(x)

    def _enter(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            return self.embed(x)
        if x.dim() != 3 or x.shape[-1] != self.hidden_size:
            raise ValueError(
                f"StageModule {self.index}: expected activations (batch, seq, {self.hidden_size}), got shape "
                f"{tuple(x.shape)}"
            )
        return x

    def _leave(self, x: torch.Tensor) -> torch.Tensor:
        if self.head is not None:
            # A tied head only exists when one stage holds everything (split_into_stages enforces it).
            x = self.head(x, self.embed.wte.weight if self.tied else None)
        return x

    def input_meta(self, batch_size: int, seq_len: int) -> tuple[tuple[int, ...], torch.dtype]:
        """``(shape, dtype)`` of the tensor this stage consumes for one microbatch (for receive buffers)."""
        if self.is_first:
            return (batch_size, seq_len), torch.long
        return self._hidden_shape(batch_size, seq_len), self.dtype

    def output_meta(self, batch_size: int, seq_len: int) -> tuple[tuple[int, ...], torch.dtype]:
        """``(shape, dtype)`` of the tensor this stage produces for one microbatch."""
        if self.is_last:
            return (batch_size, seq_len, self.vocab_size), self.dtype
        return self._hidden_shape(batch_size, seq_len), self.dtype

    def _hidden_shape(self, batch_size: int, seq_len: int) -> tuple[int, ...]:
        if self.sequence_shards == 1:
            return (batch_size, seq_len, self.hidden_size)
        return (seq_len // self.sequence_shards, batch_size, self.hidden_size)

    def extra_repr(self) -> str:
        return (
            f"index={self.index}, n_stages={self.n_stages}, layers={list(self.layers)}, "
            f"embed={self.is_first}, head={self.is_last}"
        )


def stage_layer_counts(num_layers: int, n_stages: int) -> list[int]:
    """Blocks per stage for an even cut; the first ``num_layers % n_stages`` stages get one more.

    Earlier stages take the extra blocks because the last stage already carries the LM head and the loss.
    """
    if not 1 <= n_stages <= num_layers:
        raise ValueError(
            f"stage_layer_counts: need 1 <= n_stages <= num_layers, got {n_stages=} {num_layers=}"
        )
    base, extra = divmod(num_layers, n_stages)
    return [base + (1 if i < extra else 0) for i in range(n_stages)]


def split_into_stages(
    model: GPT, n_stages: int, *, layers_per_stage: Sequence[int] | None = None
) -> list[StageModule]:
    """Cut ``model`` into ``n_stages`` contiguous :class:`StageModule`\\ s (see the module docstring).

    Args:
        model: a :class:`~splitgrad.models.GPT` or :class:`~splitgrad.models.MoEGPT`.
        n_stages: number of stages (>= 1).
        layers_per_stage: blocks per stage; default :func:`stage_layer_counts`. The first and last stage may
            hold 0 blocks (embedding only / head only); middle stages need at least one.

    Returns:
        The stages in order; they share (not copy) the model's modules.
    """
    if not isinstance(model, GPT):
        raise TypeError(
            f"split_into_stages expects a splitgrad.models.GPT or MoEGPT, got {type(model).__name__}"
        )
    num_layers = model.config.num_layers
    if n_stages < 1:
        raise ValueError(f"split_into_stages: n_stages must be >= 1, got {n_stages=}")
    if n_stages > 1 and model.config.tie_embeddings:
        raise ValueError(
            f"split_into_stages: a model with tie_embeddings=True cannot be cut into {n_stages=} stages: the tied "
            "weight would live on the first and on the last stage and its two gradient halves would never be "
            "summed. Build the model with tie_embeddings=False for pipelining."
        )
    if layers_per_stage is None:
        counts = stage_layer_counts(num_layers, n_stages)
    else:
        counts = [int(c) for c in layers_per_stage]
        middle_empty = [i for i, c in enumerate(counts) if c == 0 and 0 < i < n_stages - 1]
        if len(counts) != n_stages or sum(counts) != num_layers or min(counts) < 0 or middle_empty:
            raise ValueError(
                "split_into_stages: layers_per_stage must have n_stages non-negative entries summing to "
                f"num_layers, with no empty middle stage; got {counts=} {n_stages=} {num_layers=}"
            )
    stages, start = [], 0
    for i, count in enumerate(counts):
        stages.append(StageModule(model, i, n_stages, range(start, start + count)))
        start += count
    logger.debug("split %s into %d stages: layers per stage %s", type(model).__name__, n_stages, counts)
    return stages
