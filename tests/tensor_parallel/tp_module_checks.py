"""Checks run inside spawned gloo ranks for tensor-parallel ``LayerNormLinear``, ``LayerNormMLP`` and the TP MLP
block (column ``Linear`` -> row ``Linear``), against the single-process float64 module with the full weights.

Parameters with ``sequence_parallel = True`` hold a partial gradient (their rank's sequence shard); they are
all-reduced over the group first, as Megatron does, and a check fails if the flag is missing or superfluous.
Each mode is also compared with the TP module's immediate mode: bitwise, except the gradients a fused mode
adds into ``main_grad`` with ``addmm_`` (another kernel than immediate mode's ``mm`` then ``add_``; see
:func:`tests.tensor_parallel.tp_checks.vs_immediate`), which are float64-tight.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

import splitgrad
from tests.tensor_parallel.tp_checks import F64, TOL, _close, _null, vs_immediate

S, B, H, FFN = 6, 2, 6, 12
Slicer = Callable[[torch.Tensor], torch.Tensor]


def _blocks(n: int, rank: int, world: int) -> slice:
    return slice(rank * n // world, (rank + 1) * n // world)


def _gated_rows(rank: int, world: int) -> Slicer:
    """This rank's rows of both halves ``[a; b]`` of a gated fc1."""

    def pick(t: torch.Tensor) -> torch.Tensor:
        a, b = t.chunk(2, dim=0)
        rows = _blocks(a.shape[0], rank, world)
        return torch.cat([a[rows], b[rows]])

    return pick


def run_pair(
    ref: nn.Module, tp: nn.Module, shards: dict[str, Slicer], sp: bool, how: str, rank: int, world: int
):
    """Copy the shards into ``tp``, run 2 microbatches through both, return (ref results, tp results)."""
    with torch.no_grad():
        for name, p in tp.named_parameters():
            p.copy_(shards.get(name, lambda t: t)(dict(ref.named_parameters())[name]))
    gen = torch.Generator().manual_seed(99)
    seq = _blocks(S, rank, world) if sp else slice(None)
    out = {"ref": {"y": [], "dx": []}, "tp": {"y": [], "dx": []}, "in_main_grad": set()}
    bundles = []
    for _ in range(2):
        x = torch.randn(S, B, H, generator=gen, dtype=F64)
        y_ref = ref(x.clone().requires_grad_())
        g = torch.randn(y_ref.shape, generator=gen, dtype=F64)
        xr = x.clone().requires_grad_()
        (ref(xr) * g).sum().backward()
        out["ref"]["y"].append(y_ref.detach())
        out["ref"]["dx"].append(xr.grad[seq])
        xt = x[seq].clone().requires_grad_()
        with splitgrad.capture_wgrad() if how == "bundles" else _null() as bundle:
            yt = tp(xt)
            g_t = g[seq] if yt.shape[-1] == g.shape[-1] else g[..., _blocks(g.shape[-1], rank, world)]
            (yt * g_t).sum().backward()
        bundles += [] if bundle is None else [bundle]
        out["tp"]["y"].append(yt.detach())
        out["tp"]["dx"].append(xt.grad)
    if how == "bundles":
        for b in reversed(bundles):  # not the forward order
            b.run()
    elif how == "backward_dw":
        splitgrad.backward_dw(tp)
    splitgrad.ensure_no_pending_wgrad(tp)
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    for name, p in tp.named_parameters():
        if hasattr(p, "main_grad"):
            out["in_main_grad"].add(name)
        g = (p.main_grad if hasattr(p, "main_grad") else p.grad).clone()
        if getattr(p, "sequence_parallel", False):
            dist.all_reduce(g)
        out["tp"][name] = g
        out["ref"][name] = shards.get(name, lambda t: t)(ref_grads[name])
    return out


def _compare(out, what: str, base: dict | None, y_slicer: Slicer) -> None:
    for i in range(2):
        _close(f"{what} y[{i}]", out["tp"]["y"][i], y_slicer(out["ref"]["y"][i]), TOL)
        _close(f"{what} dx[{i}]", out["tp"]["dx"][i], out["ref"]["dx"][i], TOL)
    for name in out["tp"]:
        if name not in ("y", "dx"):
            _close(f"{what} {name}", out["tp"][name], out["ref"][name], TOL)
            if base is not None:
                fused = name in out["in_main_grad"]
                tol = vs_immediate({"fuse_wgrad_accumulation": fused})
                _close(f"{what} {name} vs immediate", out["tp"][name], base["tp"][name], tol)


MODES = [
    ("immediate", {}, "none"),
    ("delayed", {"delay_wgrad_compute": True}, "backward_dw"),
    ("fused", {"fuse_wgrad_accumulation": True}, "none"),
    ("delayed+fused, bundles", {"delay_wgrad_compute": True, "fuse_wgrad_accumulation": True}, "bundles"),
    ("regather, bundles", {"delay_wgrad_compute": True, "sp_wgrad_input": "regather"}, "bundles"),
]


def _attach_zero_main_grad(module: nn.Module) -> None:
    for p in module.parameters():
        if p.dim() == 2:
            p.main_grad = torch.zeros_like(p)


def _check_sp_flags(tp: nn.Module, sp: bool, expected: set[str], what: str) -> None:
    flagged = {n for n, p in tp.named_parameters() if getattr(p, "sequence_parallel", False)}
    if flagged != (expected if sp else set()):
        raise AssertionError(f"{what}: sequence_parallel on {sorted(flagged)}, expected {sorted(expected)}")


def check_layernorm_linear(rank: int, world: int) -> None:
    """Column LayerNormLinear (LayerNorm and RMSNorm) x SP x every mode: exact vs the full module."""
    out_f = 2 * H
    cols = _blocks(out_f, rank, world)
    shards = {"weight": lambda t: t[cols], "bias": lambda t: t[cols]}
    for norm in ("LayerNorm", "RMSNorm"):
        torch.manual_seed(5)
        ref = splitgrad.LayerNormLinear(H, out_f, normalization=norm, params_dtype=F64)
        with torch.no_grad():  # a non-trivial norm
            ref.layer_norm_weight.normal_()
        for sp in (False, True):
            base = None
            for label, kw, how in MODES:
                tp = splitgrad.LayerNormLinear(
                    H, out_f, normalization=norm, tp_group=dist.group.WORLD, parallel_mode="column",
                    sequence_parallel=sp, params_dtype=F64, **kw,
                )  # fmt: skip
                if kw.get("fuse_wgrad_accumulation"):
                    _attach_zero_main_grad(tp)
                _check_sp_flags(
                    tp,
                    sp,
                    {"layer_norm_weight", "layer_norm_bias"}
                    - ({"layer_norm_bias"} if norm == "RMSNorm" else set()),
                    f"{norm} {sp=}",
                )
                ref.zero_grad(set_to_none=True)
                out = run_pair(ref, tp, shards, sp, how, rank, world)
                _compare(out, f"LayerNormLinear {norm} {sp=} {label}", base, lambda t: t[..., cols])
                base = base or out


def check_layernorm_mlp(rank: int, world: int) -> None:
    """LayerNormMLP (fc1 column, fc2 row) x every activation x SP x every mode: exact vs the full module."""
    for act in ("gelu", "relu", "swiglu", "geglu"):
        torch.manual_seed(6)
        ref = splitgrad.LayerNormMLP(H, FFN, activation=act, params_dtype=F64)
        with torch.no_grad():
            ref.layer_norm_weight.normal_()
            ref.fc2_bias.normal_()
        gated = act in ("swiglu", "geglu")
        rows = _gated_rows(rank, world) if gated else (lambda t: t[_blocks(t.shape[0], rank, world)])
        inner = _blocks(FFN, rank, world)
        shards = {"fc1_weight": rows, "fc1_bias": rows, "fc2_weight": lambda t, cols=inner: t[:, cols]}
        for sp in (False, True):
            base = None
            for label, kw, how in MODES:
                tp = splitgrad.LayerNormMLP(
                    H,
                    FFN,
                    activation=act,
                    tp_group=dist.group.WORLD,
                    sequence_parallel=sp,
                    params_dtype=F64,
                    **kw,
                )
                if kw.get("fuse_wgrad_accumulation"):
                    _attach_zero_main_grad(tp)
                _check_sp_flags(tp, sp, {"layer_norm_weight", "layer_norm_bias", "fc2_bias"}, f"{act} {sp=}")
                ref.zero_grad(set_to_none=True)
                out = run_pair(ref, tp, shards, sp, how, rank, world)
                _compare(
                    out,
                    f"LayerNormMLP {act} {sp=} {label}",
                    base,
                    lambda t, sp=sp: t[_blocks(S, rank, world)] if sp else t,
                )
                base = base or out
    # Negative: pairing the gate with another rank's value rows is caught.
    if world > 1:
        ref = splitgrad.LayerNormMLP(H, FFN, activation="swiglu", params_dtype=F64)
        tp = splitgrad.LayerNormMLP(H, FFN, activation="swiglu", tp_group=dist.group.WORLD, params_dtype=F64)
        inner = _blocks(FFN, rank, world)
        wrong = {
            "fc1_weight": lambda t: t[_blocks(t.shape[0], rank, world)],
            "fc1_bias": lambda t: t[_blocks(t.shape[0], rank, world)],
            "fc2_weight": lambda t: t[:, inner],
        }
        out = run_pair(ref, tp, wrong, False, "none", rank, world)
        if torch.allclose(out["tp"]["y"][0], out["ref"]["y"][0], **TOL):
            raise AssertionError("swiglu with inconsistently sharded halves matched the reference")


def check_tp_mlp_block(rank: int, world: int) -> None:
    """Column Linear -> GELU -> row Linear (Megatron's MLP block) x SP x modes: exact vs the full block."""

    def block(tp: bool, sp: bool, **kw) -> nn.Sequential:
        extra = {"tp_group": dist.group.WORLD, "sequence_parallel": sp} if tp else {}
        return nn.Sequential(
            splitgrad.Linear(H, FFN, params_dtype=F64, parallel_mode="column" if tp else None, **extra, **kw),
            nn.GELU(),
            splitgrad.Linear(FFN, H, params_dtype=F64, parallel_mode="row" if tp else None, **extra, **kw),
        )

    torch.manual_seed(7)
    ref = block(False, False)
    inner = _blocks(FFN, rank, world)
    shards = {"0.weight": lambda t: t[inner], "0.bias": lambda t: t[inner], "2.weight": lambda t: t[:, inner]}
    for sp in (False, True):
        base = None
        for label, kw, how in MODES:
            tp = block(True, sp, **kw)
            if kw.get("fuse_wgrad_accumulation"):
                _attach_zero_main_grad(tp)
            _check_sp_flags(tp, sp, {"2.bias"}, f"block {sp=}")
            ref.zero_grad(set_to_none=True)
            out = run_pair(ref, tp, shards, sp, how, rank, world)
            _compare(
                out,
                f"TP MLP block {sp=} {label}",
                base,
                lambda t, sp=sp: t[_blocks(S, rank, world)] if sp else t,
            )
            base = base or out


ALL = ["check_layernorm_linear", "check_layernorm_mlp", "check_tp_mlp_block"]
