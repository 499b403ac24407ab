"""Configuration of the small GPT and its mixture-of-experts variant.

The configs only describe the architecture and how the splitgrad layers inside it behave
(``delay_wgrad_compute``, ``fuse_wgrad_accumulation``); they hold no tensors. ``MoEConfig`` extends
``GPTConfig``: every block's MLP becomes a routed mixture of experts.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

__all__ = ["ACTIVATIONS", "NORMALIZATIONS", "GPTConfig", "MoEConfig"]

logger = logging.getLogger(__name__)

#: MLP activations (the same names as :class:`splitgrad.LayerNormMLP`); gated ones double fc1's width.
ACTIVATIONS = ("gelu", "relu", "swiglu", "geglu")
#: Normalisations (the same names as :class:`splitgrad.LayerNormLinear`).
NORMALIZATIONS = ("LayerNorm", "RMSNorm")


@dataclass(kw_only=True, slots=True)
class GPTConfig:
    """A pre-norm decoder-only transformer (GPT-2 layout)."""

    vocab_size: int
    """Number of token ids; the head produces ``vocab_size`` logits per position."""
    seq_len: int
    """Longest sequence the position embedding covers; inputs may be shorter."""
    hidden_size: int = 64
    """Width of the residual stream."""
    num_layers: int = 2
    """Number of transformer blocks (the unit a pipeline stage is cut along)."""
    num_heads: int = 4
    """Attention heads; must divide ``hidden_size``."""
    ffn_hidden_size: int | None = None
    """MLP inner width; ``None`` means ``4 * hidden_size``."""
    activation: str = "gelu"
    """One of :data:`ACTIVATIONS` (``gelu`` is the tanh approximation, as in GPT-2 and TE)."""
    normalization: str = "LayerNorm"
    """One of :data:`NORMALIZATIONS`, used by every norm in the model."""
    layernorm_epsilon: float = 1e-5
    """``eps`` of every norm."""
    zero_centered_gamma: bool = False
    """Norm scales are stored as ``gamma - 1`` (TE's convention; weight decay then pulls towards 1)."""
    bias: bool = True
    """Learn biases in the linear layers (the LM head never has one)."""
    tie_embeddings: bool = False
    """Reuse the token embedding as the LM head. Untied by default: a tied model cannot be cut into
    pipeline stages, because the weight would live on the first and the last stage at once."""
    dropout: float = 0.0
    """Dropout on embeddings, attention probabilities and residual branches. Keep 0 for deterministic
    runs (the tests and the pipeline comparisons need bitwise repeatable forwards)."""
    init_std: float = 0.02
    """Standard deviation of the normal initialisation of every matrix (GPT-2); the output projections of
    each residual branch are scaled by ``1 / sqrt(2 * num_layers)``."""
    delay_wgrad_compute: bool = False
    """Build every splitgrad layer with deferred weight gradients (``splitgrad.backward_dw(model)``)."""
    fuse_wgrad_accumulation: bool = False
    """Splitgrad layers add weight gradients into ``param.main_grad`` (set by a data-parallel wrapper)."""
    params_dtype: torch.dtype | None = None
    """Parameter dtype; ``None`` means torch's default dtype."""
    tp_size: int = 1
    """Tensor-parallel ranks: attention heads and the MLP's inner size are split over them (``GPT(config,
    tp_group=...)``, see docs/tensor_parallel.md); 1 is the unsplit model."""
    sequence_parallel: bool = False
    """With ``tp_size > 1``: the residual stream between the embedding and the head is sequence-first and
    sharded on the sequence, ``(seq / tp_size, batch, hidden)`` (Megatron's sequence parallelism); the
    sequence length of every input must then divide by ``tp_size``. A no-op with ``tp_size=1`` (as TE)."""

    def __post_init__(self) -> None:
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        positive = {
            "vocab_size": self.vocab_size,
            "seq_len": self.seq_len,
            "hidden_size": self.hidden_size,
            "num_layers": self.num_layers,
            "num_heads": self.num_heads,
            "ffn_hidden_size": self.ffn_hidden_size,
        }
        bad = {k: v for k, v in positive.items() if not isinstance(v, int) or v <= 0}
        if bad:
            raise ValueError(f"{type(self).__name__}: these sizes must be positive ints, got {bad}")
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"{type(self).__name__}: num_heads must divide hidden_size, got "
                f"hidden_size={self.hidden_size} num_heads={self.num_heads}"
            )
        if not isinstance(self.tp_size, int) or self.tp_size < 1 or self.num_heads % self.tp_size:
            raise ValueError(
                f"{type(self).__name__}: tp_size must be a positive int dividing num_heads, got "
                f"tp_size={self.tp_size} num_heads={self.num_heads}"
            )
        if self.ffn_hidden_size % self.tp_size:
            raise ValueError(
                f"{type(self).__name__}: tp_size must divide ffn_hidden_size, got "
                f"tp_size={self.tp_size} ffn_hidden_size={self.ffn_hidden_size}"
            )
        if self.activation not in ACTIVATIONS:
            raise ValueError(
                f"{type(self).__name__}: activation must be one of {ACTIVATIONS}, got {self.activation=}"
            )
        if self.normalization not in NORMALIZATIONS:
            raise ValueError(
                f"{type(self).__name__}: normalization must be one of {NORMALIZATIONS}, got {self.normalization=}"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"{type(self).__name__}: dropout must be in [0, 1), got {self.dropout=}")
        if self.layernorm_epsilon <= 0 or self.init_std <= 0:
            raise ValueError(
                f"{type(self).__name__}: layernorm_epsilon and init_std must be positive, got "
                f"{self.layernorm_epsilon=} {self.init_std=}"
            )

    @property
    def head_dim(self) -> int:
        """``hidden_size // num_heads``."""
        return self.hidden_size // self.num_heads


@dataclass(kw_only=True, slots=True)
class MoEConfig(GPTConfig):
    """A GPT whose every MLP is a dropless top-k mixture of experts (no capacity limit, no token dropped)."""

    num_experts: int = 4
    """Experts per MoE layer (one ``GroupedLinear`` GEMM group each for fc1 and fc2)."""
    top_k: int = 2
    """Experts each token is sent to."""
    moe_ffn_hidden_size: int | None = None
    """Inner width of one expert; ``None`` means ``ffn_hidden_size``."""
    moe_single_grouped_weight: bool = False
    """Megatron-Core's ``moe_single_grouped_weight`` (TE's ``single_grouped_weight`` and ``single_grouped_bias``):
    each expert GEMM ``fc1`` / ``fc2`` holds one ``weight`` ``(experts, out, in)`` (and one ``bias``
    ``(experts, out)``) instead of ``weight0 ..`` / ``bias0 ..``."""
    norm_topk_prob: bool = False
    """Renormalise the top-k routing probabilities to sum to 1 per token (Mixtral); off, the weights are
    the plain softmax probabilities (Switch/GShard)."""
    aux_loss_coef: float = 1e-2
    """Weight of the load-balancing loss ``num_experts * sum_i f_i * P_i`` of every MoE layer."""
    router_force_load_balancing: bool = False
    """For benchmarks only (Megatron-Core's ``moe_router_force_load_balancing``): copy ``j`` of token ``t`` of a
    layer's input (flattened, ``t < T``) goes to expert ``(t * top_k + j) % num_experts`` whatever the scores,
    so every expert receives the same number of copies when ``T * top_k`` divides by ``num_experts`` (at most
    one apart otherwise) and no expert-parallel rank waits for a busier one. The router's probabilities still
    weight the copies and feed the aux loss, so every parameter keeps its gradient. Expert parallelism then
    matches the single-process model on the global batch when each rank's ``T * top_k`` divides by
    ``num_experts`` (a token's experts depend on its index)."""

    def __post_init__(self) -> None:
        # Explicit base call: zero-argument super() breaks in slots dataclasses (the class is recreated).
        GPTConfig.__post_init__(self)
        if self.moe_ffn_hidden_size is None:
            self.moe_ffn_hidden_size = self.ffn_hidden_size
        if self.num_experts <= 0 or self.moe_ffn_hidden_size <= 0:
            raise ValueError(
                f"MoEConfig: num_experts and moe_ffn_hidden_size must be positive, got "
                f"{self.num_experts=} {self.moe_ffn_hidden_size=}"
            )
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(
                f"MoEConfig: top_k must be in [1, num_experts], got {self.top_k=} {self.num_experts=}"
            )
        if self.aux_loss_coef < 0:
            raise ValueError(f"MoEConfig: aux_loss_coef must be >= 0, got {self.aux_loss_coef=}")
