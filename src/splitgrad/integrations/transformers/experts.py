"""HuggingFace v5 experts modules with a split backward: the layer-side half of the transformers integration.

A decorated experts module (``@use_experts_implementation``: ``MixtralExperts``, ``GptOssExperts``, ...) is
converted **in place** by giving the instance a subclass of its own class (``SplitMixtralExperts``), the way
FSDP2's ``fully_shard`` does: the object, its ``Parameter`` objects, their names and ``state_dict`` keys, its
hooks and ``isinstance(m, MixtralExperts)`` all stay; only ``forward`` changes, to :func:`experts_forward`.

That forward follows transformers' own ``grouped_mm`` implementation step by step (sort the ``(token, k)``
pairs by expert, one grouped GEMM up, the family's activation, one grouped GEMM down, optional per-expert
norm, routing weights, unsort, sum over ``k``), with both GEMMs and the activation inside one autograd Function
(:class:`_ExpertsFunction`), so one backward parks *one* task writing both weights: one ``backward_dw()``
completes the layer and its wgrad hooks fire once. What the layout needs comes from the flags the decorator
set on the instance — ``has_gate`` (``gate_up_proj`` or ``up_proj``), ``has_bias`` (``*_bias``),
``is_transposed`` (``(E, in, out)`` weights), ``has_post_expert_norm`` — and the class's own
``_apply_gate`` / ``act_fn``, so interleaved gpt-oss halves, clamped swiglu or softcapped gates need no table.
Routing (top-k ids and weights) is the caller's, untouched. Expert ids ``>= num_experts`` (transformers'
expert-parallel sentinel) contribute zero, as in transformers' implementations.

Why not a ``"splitgrad"`` entry in transformers' experts registry (``ExpertsInterface.register``)? That
registry is process-wide and its choice is per config (every experts module of a model at once), and a
registered function cannot make the module split-capable: the store, hooks and TE's methods must live on
the module, for ``splitgrad.split_modules`` and the optimizer guard to see it. The swap changes one module,
explicitly, and nothing global. A converted module ignores a later ``set_experts_implementation``.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
from torch import nn

from ...core import SplitModule, split_backward
from ...functional.grouped_gemm import group_offsets, grouped_dgrad, grouped_forward
from ...functional.grouped_wgrad import GroupedParams, grouped_gradients, grouped_targets, write_grouped_wgrad
from ...functional.wgrad import check_targets

__all__ = ["SplitExperts", "experts_forward", "split_experts_class"]


class _ExpertsFunction(torch.autograd.Function):
    """``y = down(act(up(x)))`` per expert group: the two grouped GEMMs and the activation of one experts call.

    Shapes: ``x: (rows, H)`` sorted by expert, ``splits``: rows per expert -> ``(rows, H)``. The family's gate
    may be any differentiable torch code, so the forward records it with autograd (on a detached copy of the
    up projection's output) and the backward asks autograd for its input gradient: the gate saves what it
    would save in the unconverted model, and runs once.
    """

    @staticmethod
    def forward(ctx, x, splits: list[int], owner: SplitExperts, *params):  # type: ignore[override]
        up, down = owner.expert_linears(params)
        real = owner.expert_linears()
        ctx.owner, ctx.splits, ctx.layout = owner, splits, (up, down)
        ctx.params = tuple(real[0].tensors + real[1].tensors)
        ctx.split = owner.splits_wgrad()
        ctx.offs = offs = group_offsets(splits, x.device)  # grouped_mm's; unused by the loop
        h = grouped_forward(x, up.weight, splits, bias=up.bias, transposed=up.transposed, offs=offs)
        ctx.gate = None
        if any(ctx.needs_input_grad):
            with torch.enable_grad():
                h_in = h.detach().requires_grad_()
                gate_out = owner.expert_activation(h_in)
            ctx.gate = (h_in, gate_out)  # a private graph, freed with ctx
            a = gate_out.detach()
        else:
            a = owner.expert_activation(h)
        ctx.save_for_backward(x, a, up.weight, down.weight)
        return grouped_forward(a, down.weight, splits, bias=down.bias, transposed=down.transposed, offs=offs)

    @staticmethod
    @split_backward
    def backward(ctx, dy):  # type: ignore[override]
        x, a, w_up, w_down = ctx.saved_tensors
        owner: SplitExperts = ctx.owner
        up, down = ctx.layout
        splits, offs = ctx.splits, ctx.offs
        n_up = len(up.tensors)
        need = ctx.needs_input_grad
        dy = dy.contiguous()  # grouped_mm refuses broadcast gradients
        dh = None
        if need[0] or any(need[3 : 3 + n_up]):
            da = grouped_dgrad(dy, w_down, splits, transposed=down.transposed, offs=offs)
            h_in, gate_out = ctx.gate
            # retain_graph: a backward(retain_graph=True) of the model may come through here again.
            (dh,) = torch.autograd.grad(gate_out, h_in, da, retain_graph=True)
        dx = grouped_dgrad(dh, w_up, splits, transposed=up.transposed, offs=offs) if need[0] else None

        def gradients(mask: tuple[bool, ...]) -> list[torch.Tensor | None]:
            first = (
                grouped_gradients(up, dh, x, splits, mask[:n_up], offs) if dh is not None else [None] * n_up
            )
            return first + grouped_gradients(down, dy, a, splits, mask[n_up:], offs)

        def write(mask: tuple[bool, ...]) -> None:
            owner._write_wgrad(dy, a, dh, x, splits, mask, offs)

        saved = (dy, a) if dh is None else (dy, a, dh, x)
        grads = owner.hand_over_wgrad(
            ctx.params, need[3:], split=ctx.split, gradients=gradients, write=write, saved=saved,
            create_graph=ctx.create_graph,
        )  # fmt: skip
        return (dx, None, None, *grads)


class SplitExperts(SplitModule):
    """Mixin of the converted experts classes (``Split<HFClass>``); see the module docstring.

    Built only by :func:`splitgrad.convert` (or :func:`~splitgrad.integrations.transformers.convert_experts`),
    which swaps an experts instance's class and calls :meth:`init_split`.
    """

    _splitgrad_base: type[nn.Module]
    _splitgrad_routing: tuple[str, str]

    # -- layout, read from the decorator's flags ---------------------------------------------------------
    def expert_linears(
        self, tensors: tuple[torch.Tensor, ...] | None = None
    ) -> tuple[GroupedParams, GroupedParams]:
        """The up (``gate_up_proj`` or ``up_proj``) and ``down_proj`` grouped linears, with their biases.

        Args:
            tensors: stand-ins for the parameters in :meth:`wgrad_parameters` order (what the Function got).
        """
        names = self._expert_parameter_names()
        given = dict(zip(names, tensors)) if tensors is not None else {n: getattr(self, n) for n in names}
        up = "gate_up_proj" if self.has_gate else "up_proj"
        bias = self.has_bias
        return (
            GroupedParams(given[up], given.get(f"{up}_bias") if bias else None, self.is_transposed, up, f"{up}_bias"),
            GroupedParams(
                given["down_proj"], given.get("down_proj_bias") if bias else None, self.is_transposed, "down_proj",
                "down_proj_bias",
            ),
        )  # fmt: skip

    def _expert_parameter_names(self) -> list[str]:
        up = "gate_up_proj" if self.has_gate else "up_proj"
        names = [up, "down_proj"]
        if self.has_bias:
            names = [up, f"{up}_bias", "down_proj", "down_proj_bias"]
        return names

    def expert_activation(self, h: torch.Tensor) -> torch.Tensor:
        """The family's activation of the up projection: ``_apply_gate`` (gated) or ``act_fn``."""
        return self._apply_gate(h) if self.has_gate else self.act_fn(h)

    def wgrad_parameters(self) -> list[nn.Parameter]:
        return [getattr(self, n) for n in self._expert_parameter_names()]

    # -- forward -------------------------------------------------------------------------------------------
    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        """The experts call of the HF class's signature: ``(hidden_states, top_k_index, top_k_weights)``
        (gpt-oss: ``router_indices``, ``routing_weights``), positional or by name."""
        names = self._splitgrad_routing
        values = dict(zip(names, args))
        values.update(kwargs)
        missing = [n for n in names if values.get(n) is None]
        if missing or len(args) > 2 or set(values) - set(names):
            raise ValueError(
                f"{self._describe()}: expected forward(hidden_states, {names[0]}, {names[1]}), got "
                f"{len(args)} positional argument(s) and keywords {sorted(kwargs)}"
            )
        return experts_forward(self, hidden_states, values[names[0]], values[names[1]])

    def _write_wgrad(
        self,
        dy: torch.Tensor,
        a: torch.Tensor,
        dh: torch.Tensor | None,
        x: torch.Tensor,
        splits: list[int],
        mask: tuple[bool, ...],
        offs: torch.Tensor | None = None,
    ) -> None:
        """Write ``down_proj``'s then the up projection's masked gradients (both checked before either)."""
        up, down = self.expert_linears()
        n_up = len(up.tensors)
        mask_up = mask[:n_up] if dh is not None else (False,) * n_up
        fused, owner = self.fuse_wgrad_accumulation, self._describe()
        check_targets(
            grouped_targets(up, mask_up, fused=fused) + grouped_targets(down, mask[n_up:], fused=fused),
            owner=owner,
        )
        write_grouped_wgrad(down, dy, a, splits, mask[n_up:], fused=fused, owner=owner, offs=offs)
        if dh is not None:
            write_grouped_wgrad(up, dh, x, splits, mask_up, fused=fused, owner=owner, offs=offs)

    def extra_repr(self) -> str:
        up, down = self.expert_linears()
        return (
            f"num_experts={self.num_experts}, {up.weight_name}={tuple(up.weight.shape)}, "
            f"down_proj={tuple(down.weight.shape)}, transposed={self.is_transposed}, bias={self.has_bias}"
        )

    def __reduce_ex__(self, protocol: int) -> tuple:
        # The class is made at run time, so pickle (and deepcopy) rebuild it from the importable HF class.
        return (_rebuild, (self._splitgrad_base,), self.__getstate__())


def _rebuild(base: type[nn.Module]) -> SplitExperts:
    return object.__new__(split_experts_class(base))


# One derived class per HF class, so converted instances of one family share a class (isinstance, repr,
# pickling); the cache only ever maps a class to the same immutable derived class.
@functools.cache
def split_experts_class(base: type[nn.Module]) -> type[SplitExperts]:
    """``Split<base>``: a subclass of :class:`SplitExperts` and of the HF experts class ``base``."""
    params = list(inspect.signature(base.forward).parameters)[1:4]  # self, hidden_states, ids, weights
    return type(
        f"Split{base.__name__}",
        (SplitExperts, base),
        {"__module__": __name__, "_splitgrad_base": base, "_splitgrad_routing": tuple(params[1:3])},
    )


def experts_forward(
    module: SplitExperts, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """transformers' ``grouped_mm`` experts forward with the GEMMs in a split autograd Function.

    Args:
        module: a converted experts module.
        hidden_states: ``(tokens, H)`` (leading dimensions are flattened and restored).
        top_k_index: ``(tokens, K)`` expert ids (ids ``>= num_experts`` contribute zero).
        top_k_weights: ``(tokens, K)`` routing weights (any float dtype: the product is taken in the promoted
            dtype and cast back to ``hidden_states.dtype``, as transformers does).

    Returns:
        ``hidden_states``-shaped output.
    """
    lead, hidden = hidden_states.shape[:-1], hidden_states.shape[-1]
    h = hidden_states.reshape(-1, hidden)
    tokens, k = h.shape[0], top_k_index.shape[-1]
    experts = module.num_experts
    ids = top_k_index.reshape(-1)
    ids_sorted, perm = torch.sort(ids, stable=True)
    # Host sizes, as TE's GroupedLinear needs them (one sync per call on an accelerator).
    counts = torch.bincount(ids_sorted.clamp(max=experts), minlength=experts + 1).tolist()
    splits, rows = counts[:experts], sum(counts[:experts])
    up, down = module.expert_linears()
    x = h[perm[:rows] // k].to(up.weight.dtype)
    y = module.apply_function(_ExpertsFunction, x, splits, module, *up.tensors, *down.tensors)
    if module.has_post_expert_norm:
        y = module.post_expert_norm(y)
    if rows < ids.shape[0]:  # sentinel ids sort last
        y = torch.cat([y, y.new_zeros(ids.shape[0] - rows, hidden)])
    weighted = y * top_k_weights.reshape(-1)[perm].unsqueeze(-1)
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.shape[0], device=perm.device)
    out = weighted[inverse].view(tokens, k, hidden).sum(dim=1)
    return out.to(hidden_states.dtype).view(*lead, hidden)
