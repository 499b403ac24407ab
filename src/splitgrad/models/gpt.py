"""A small GPT built from splitgrad layers (pre-norm blocks, learned positions, tied or untied head).

Layout of one block (the residual stream ``x: (batch, seq, hidden)``; ``(seq / tp, batch, hidden)`` under
sequence parallelism)::

    x = x + proj(sdpa_causal(split_heads(LayerNormLinear_qkv(x))))     # attention branch
    x = x + LayerNormMLP(x)                                             # MLP branch (MoE: MoEMLP)

Every matrix multiply of a block (QKV, output projection, fc1, fc2) and the untied LM head is a splitgrad layer,
so ``config.delay_wgrad_compute=True`` defers all of their weight gradients to ``splitgrad.backward_dw(model)``
(or to a ``capture_wgrad`` bundle). Embeddings and norms outside the fused layers are plain autograd: their
gradients are written during backward like any ``nn.Module``'s.

The model is a sequence of pieces ``[embed, *blocks, head]`` (:meth:`GPT.pieces`);
:func:`splitgrad.models.split_into_stages` cuts that sequence into pipeline stages.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..core.steps import Steps, child_steps
from ..distributed.group_ref import GroupRef
from ..distributed.tp_config import TensorParallelConfig, tensor_parallel_config
from ..distributed.tp_sequence import gather_sequence, split_sequence
from ..module.layernorm_linear import LayerNormLinear
from ..module.layernorm_mlp import LayerNormMLP
from ..module.linear import Linear
from .config import GPTConfig

__all__ = ["GPT", "Attention", "Block", "Embedding", "Head", "Norm", "lm_loss"]

logger = logging.getLogger(__name__)


def _tp_kwargs(tp_group: dist.ProcessGroup | None, config: GPTConfig, mode: str | None) -> dict:
    """Tensor-parallel keywords of one layer (none for the unsplit model)."""
    if config.tp_size == 1:
        return {}
    kw = {"tp_group": tp_group, "tp_size": config.tp_size, "sequence_parallel": config.sequence_parallel}
    return kw if mode is None else {**kw, "parallel_mode": mode}


def sequence_parallel_config(
    tp_group: dist.ProcessGroup | None, config: GPTConfig
) -> TensorParallelConfig | None:
    """The config of the model's sequence-parallel region, or None when the residual stream is not sharded."""
    if config.tp_size == 1 or not config.sequence_parallel:
        return None
    return tensor_parallel_config(
        tp_group=tp_group, tp_size=config.tp_size, parallel_mode="column", sequence_parallel=True, owner="GPT"
    )


def split_kwargs(config: GPTConfig) -> dict:
    """Keyword arguments every splitgrad layer of the model gets."""
    return {
        "delay_wgrad_compute": config.delay_wgrad_compute,
        "fuse_wgrad_accumulation": config.fuse_wgrad_accumulation,
        "params_dtype": config.params_dtype,
    }


class Norm(nn.Module):
    """A plain-autograd LayerNorm/RMSNorm with TE's parameter conventions (the final norm, MoE pre-norms).

    Parameters: ``weight: (hidden,)`` (stored as ``gamma - 1`` with ``zero_centered_gamma``) and, for
    LayerNorm, ``bias: (hidden,)``.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.normalization = config.normalization
        self.eps = config.layernorm_epsilon
        self.zero_centered_gamma = config.zero_centered_gamma
        h, dtype = config.hidden_size, config.params_dtype
        init = torch.zeros if config.zero_centered_gamma else torch.ones
        self.weight = nn.Parameter(init(h, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(h, dtype=dtype)) if config.normalization == "LayerNorm" else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x: (..., hidden)`` -> ``(..., hidden)``."""
        gamma = self.weight + 1 if self.zero_centered_gamma else self.weight
        shape = (x.shape[-1],)
        if self.normalization == "LayerNorm":
            return F.layer_norm(x, shape, gamma, self.bias, self.eps)
        return F.rms_norm(x, shape, gamma, self.eps)


class Embedding(nn.Module):
    """Token plus learned position embedding: ``ids: (batch, seq) int64`` -> ``(batch, seq, hidden)``.

    With ``sp`` (sequence parallelism) the output enters the sharded region: ``(seq / tp, batch, hidden)``,
    this rank's sequence block of the (replicated) embedding; backward all-gathers the blocks' gradients, so
    the embedding gradients are whole and identical on every TP rank.
    """

    def __init__(self, config: GPTConfig, sp: TensorParallelConfig | None = None) -> None:
        super().__init__()
        self.sp = sp
        self.seq_len = config.seq_len
        self.dropout = config.dropout
        self.wte = nn.Embedding(config.vocab_size, config.hidden_size, dtype=config.params_dtype)
        self.wpe = nn.Embedding(config.seq_len, config.hidden_size, dtype=config.params_dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.dim() != 2 or ids.dtype != torch.long:
            raise ValueError(
                f"Embedding: token ids must be (batch, seq) int64, got shape {tuple(ids.shape)} dtype {ids.dtype}"
            )
        if ids.shape[1] > self.seq_len:
            raise ValueError(
                f"Embedding: sequence of {ids.shape[1]} tokens is longer than seq_len={self.seq_len}"
            )
        pos = torch.arange(ids.shape[1], device=ids.device)
        x = self.wte(ids) + self.wpe(pos)
        if self.sp is not None:
            # Dropout after the split, on this rank's block (as Megatron): the RNG draws differ from tp=1.
            x = split_sequence(x.transpose(0, 1), self.sp)
        return F.dropout(x, self.dropout, self.training)


class Attention(nn.Module):
    """Causal multi-head self-attention branch: ``(batch, seq, hidden)`` -> ``(batch, seq, hidden)``.

    ``qkv`` (a :class:`~splitgrad.LayerNormLinear`, the block's pre-norm fused in) produces ``[q | k | v]``
    along the last dimension, each split into ``num_heads`` contiguous heads; attention is
    ``F.scaled_dot_product_attention(..., is_causal=True)``; ``proj`` is a :class:`~splitgrad.Linear`.
    With ``config.tp_size > 1``, ``qkv`` is column-parallel (this rank's heads of q, k and v: ``[q_r | k_r |
    v_r]``), attention runs on ``num_heads / tp_size`` heads and ``proj`` is row-parallel. With
    ``config.sequence_parallel`` the branch maps ``(seq / tp, batch, hidden)`` to the same: ``qkv`` all-gathers
    the sequence, ``proj`` reduce-scatters it.
    """

    def __init__(self, config: GPTConfig, tp_group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        self.num_heads = config.num_heads // config.tp_size  # this rank's heads
        self.dropout = config.dropout
        h = config.hidden_size
        self.qkv = LayerNormLinear(
            h,
            3 * h,
            config.layernorm_epsilon,
            config.bias,
            normalization=config.normalization,
            zero_centered_gamma=config.zero_centered_gamma,
            **_tp_kwargs(tp_group, config, "column"),
            **split_kwargs(config),
        )
        self.proj = Linear(h, h, config.bias, **_tp_kwargs(tp_group, config, "row"), **split_kwargs(config))
        self.head_dim = config.head_dim
        self.seq_first = sequence_parallel_config(tp_group, config) is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)
        if self.seq_first:
            # (s, b, 3, heads, hd) -> three (b, heads, s, hd): qkv gathered the whole sequence
            s, b, _ = qkv.shape
            q, k, v = qkv.view(s, b, 3, self.num_heads, self.head_dim).permute(2, 1, 3, 0, 4).unbind(0)
        else:
            # (b, s, 3, heads, hd) -> three (b, heads, s, hd)
            b, s, _ = qkv.shape
            q, k, v = qkv.view(b, s, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        y = y.permute(2, 0, 1, 3) if self.seq_first else y.transpose(1, 2)  # (s, b, ...) or (b, s, ...)
        return self.proj(y.reshape(*y.shape[:2], self.num_heads * self.head_dim))


class Block(nn.Module):
    """One pre-norm transformer block: ``x + attn(x)`` then ``x + mlp(x)``, on ``(batch, seq, hidden)``.

    Args:
        config: the model's config.
        mlp: the MLP branch (norm included): a :class:`~splitgrad.LayerNormMLP` or an MoE layer.
    """

    def __init__(self, config: GPTConfig, mlp: nn.Module, tp_group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        self.dropout = config.dropout
        self.attn = Attention(config, tp_group)
        self.mlp = mlp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self._attention(x)
        return x + F.dropout(self.mlp(x), self.dropout, self.training)

    def forward_steps(self, x: torch.Tensor) -> Steps:
        """:meth:`forward` as steps: the MLP branch's, when it has any (see :mod:`splitgrad.core.steps`).

        A twin of :meth:`forward` rather than its driver: a generator in every plain forward would cost
        ``torch.compile`` its single graph."""
        x = self._attention(x)
        mlp = yield from child_steps(self.mlp, x)
        return x + F.dropout(mlp, self.dropout, self.training)

    def _attention(self, x: torch.Tensor) -> torch.Tensor:
        """The checked input plus the attention branch."""
        if x.dim() != 3:
            raise ValueError(
                f"Block: input must be (batch, seq, hidden) (sequence parallel: (seq / tp, batch, hidden)), got "
                f"shape {tuple(x.shape)}"
            )
        return x + F.dropout(self.attn(x), self.dropout, self.training)

    def residual_output_weights(self) -> list[nn.Parameter]:
        """The matrices that write into the residual stream (GPT-2 scales their initialisation down)."""
        mlp_out = getattr(self.mlp, "residual_output_weights", None)
        out = list(mlp_out()) if mlp_out is not None else [self.mlp.fc2_weight]
        return [self.attn.proj.weight, *out]


class Head(nn.Module):
    """Final norm and LM head: ``(batch, seq, hidden)`` -> logits ``(batch, seq, vocab)``.

    Untied, the projection is a bias-free :class:`~splitgrad.Linear` (``proj``); tied, the caller passes the
    token embedding ``(vocab, hidden)`` to :meth:`forward` and ``proj`` is None.

    With ``sp`` the input ``(seq / tp, batch, hidden)`` leaves the sharded region first: all-gathered and made
    batch-first; the norm and the head then run replicated on every TP rank, so their gradients are whole (a
    backward keeps this rank's block of the gradient, which is the same on every rank).
    """

    def __init__(self, config: GPTConfig, sp: TensorParallelConfig | None = None) -> None:
        super().__init__()
        self.sp = sp
        self.norm = Norm(config)
        self.tied = config.tie_embeddings
        self.proj = (
            None
            if self.tied
            else Linear(config.hidden_size, config.vocab_size, False, **split_kwargs(config))
        )

    def forward(self, x: torch.Tensor, tied_weight: torch.Tensor | None = None) -> torch.Tensor:
        if (tied_weight is None) == self.tied:
            raise ValueError(
                f"Head: tie_embeddings={self.tied} needs tied_weight {'given' if self.tied else 'None'}, "
                f"got {'None' if tied_weight is None else 'a tensor'}"
            )
        if self.sp is not None:
            x = gather_sequence(x, self.sp, partial_grad=False).transpose(0, 1)
        x = self.norm(x)
        return F.linear(x, tied_weight) if self.tied else self.proj(x)


class GPT(nn.Module):
    """The small GPT: ``ids: (batch, seq) int64`` -> logits ``(batch, seq, vocab_size)``.

    Args:
        config: architecture and splitgrad switches (see :class:`GPTConfig`).
        device: where to create the parameters (default: torch's default device).
        tp_group: the tensor-parallel group of ``config.tp_size`` ranks (required when it is > 1): every
            block's heads and MLP inner size are split over it; embeddings, norms and the head are
            replicated (their gradients are identical on every TP rank). Load a ``tp_size=1`` model's weights
            with :func:`splitgrad.models.shard_gpt_state_dict`. With ``config.sequence_parallel`` the
            residual stream is sharded on the sequence between the embedding and the head; the gradients of
            the block norms and row biases are then partial (``param.sequence_parallel``): call
            :func:`splitgrad.parallel.tensor.allreduce_sequence_parallel_grads` once per step, after
            ``backward_dw``.
        make_mlp: ``make_mlp(config, layer)`` builds block ``layer``'s MLP branch ``(batch, seq, hidden) ->
            (batch, seq, hidden)`` (the MoE models pass theirs); None: the dense ``LayerNormMLP``. Called during
            construction only, in block order.
    """

    def __init__(
        self,
        config: GPTConfig,
        *,
        device: torch.device | str | None = None,
        tp_group: dist.ProcessGroup | None = None,
        make_mlp: Callable[[GPTConfig, int], nn.Module] | None = None,
    ) -> None:
        super().__init__()
        if config.tp_size > 1 and (tp_group is None or dist.get_world_size(tp_group) != config.tp_size):
            got = None if tp_group is None else dist.get_world_size(tp_group)
            raise ValueError(f"GPT: tp_size={config.tp_size} needs a tp_group of that size, got {got}")
        self.config = config
        # The default group is looked up at use, another held weakly (distributed/group_ref.py): a model left
        # in a script's globals must not keep the group's gloo workers alive past destroy_process_group().
        self._tp_group = None if tp_group is None else GroupRef(tp_group, owner="GPT.tp_group")
        sp = sequence_parallel_config(tp_group, config)
        self.embed = Embedding(config, sp)
        make_mlp = self._dense_mlp if make_mlp is None else make_mlp
        self.blocks = nn.ModuleList(
            Block(config, make_mlp(config, i), tp_group) for i in range(config.num_layers)
        )
        self.head = Head(config, sp)
        self.reset_parameters()
        if device is not None:
            self.to(device)

    @property
    def tp_group(self) -> dist.ProcessGroup | None:
        """The tensor-parallel group the model was built with (None: unsplit)."""
        return None if self._tp_group is None else self._tp_group.get()

    def _dense_mlp(self, config: GPTConfig, layer: int) -> nn.Module:
        """The dense MLP branch of block ``layer`` (a ``LayerNormMLP``, split over the TP group)."""
        del layer
        return LayerNormMLP(
            config.hidden_size,
            config.ffn_hidden_size,
            config.layernorm_epsilon,
            config.bias,
            normalization=config.normalization,
            activation=config.activation,
            zero_centered_gamma=config.zero_centered_gamma,
            **_tp_kwargs(self.tp_group, config, None),
            **split_kwargs(config),
        )

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """GPT-2 initialisation: matrices ~ N(0, init_std), residual outputs / sqrt(2L), biases 0, norms 1."""
        std = self.config.init_std
        for name, param in self.named_parameters():
            # Biases first: a single grouped bias (experts, out) is 2-D.
            if name.rsplit(".", 1)[-1].startswith("bias") or name.endswith("_bias"):
                param.zero_()
            elif param.dim() >= 2:
                param.normal_(0.0, std)
        for block in self.blocks:
            for weight in block.residual_output_weights():
                weight.normal_(0.0, std / math.sqrt(2 * self.config.num_layers))

    def pieces(self) -> list[nn.Module]:
        """The model as an ordered sequence ``[embed, *blocks, head]`` (what pipeline stages are cut from)."""
        return [self.embed, *self.blocks, self.head]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids: (batch, seq) int64`` -> logits ``(batch, seq, vocab_size)`` (feed to :func:`lm_loss`)."""
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x, self.embed.wte.weight if self.config.tie_embeddings else None)

    def forward_steps(self, ids: torch.Tensor) -> Steps:
        """:meth:`forward` as steps: each block's (see :mod:`splitgrad.core.steps`; a twin, as
        :meth:`Block.forward_steps`)."""
        x = self.embed(ids)
        for block in self.blocks:
            x = yield from child_steps(block, x)
        return self.head(x, self.embed.wte.weight if self.config.tie_embeddings else None)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of one (micro)batch.

    MoE models need nothing more: their load-balancing loss enters through backward (see
    :class:`splitgrad.models.moe.AuxLossInjector`).

    Args:
        logits: ``(batch, seq, vocab)``.
        targets: ``(batch, seq)`` int64 token ids.

    Returns:
        A scalar; half-precision logits are upcast to fp32 first.
    """
    if logits.dim() != 3 or targets.shape != logits.shape[:2]:
        raise ValueError(
            f"lm_loss: logits must be (batch, seq, vocab) and targets (batch, seq), got "
            f"{tuple(logits.shape)=} {tuple(targets.shape)=}"
        )
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
