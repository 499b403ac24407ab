"""splitgrad's composite modules vs their plain-PyTorch equivalents, forward + backward (+ backward_dw).

Run: ``.venv/bin/python benchmarks/bench_modules.py [--tokens 2048 --hidden 512 --rounds 9 --device cpu]``

* LayerNormLinear vs ``nn.LayerNorm -> nn.Linear``;
* LayerNormMLP vs ``nn.LayerNorm -> nn.Linear -> GELU(tanh) -> nn.Linear``;
* GroupedLinear vs a Python loop of one ``nn.Linear`` per expert (``split -> linear -> cat``), for a few
  expert counts (tokens spread evenly).

Every variant runs the same GEMMs, so the ideal ratio is 1.00 (GroupedLinear saves the split/cat copies and
per-expert autograd nodes, which matter when experts are many and small).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
from torch import nn

import splitgrad.module as sgm
from _timing import CLOCKS, interleaved_medians, print_table


def _timed(fn: Callable[[], None], device: torch.device) -> Callable[[], None]:
    if device.type != "cuda":
        return fn

    def run() -> None:
        fn()
        torch.cuda.synchronize(device)

    return run


def _step(module: nn.Module, x: torch.Tensor, dy: torch.Tensor, call, drain: bool) -> None:
    module.zero_grad(set_to_none=True)
    x.grad = None
    call(module, x).backward(dy)
    if drain:
        module.backward_dw()


def _variants(ref: nn.Module, make, call_ref, call, x, dy, device) -> dict[str, Callable[[], None]]:
    """torch, splitgrad immediate, delayed and delayed+fused, all holding ``ref``'s values."""
    mods = {
        "immediate": make(delay_wgrad_compute=False),
        "delayed": make(delay_wgrad_compute=True),
        "delayed + fused": make(delay_wgrad_compute=True, fuse_wgrad_accumulation=True),
    }
    for m in mods["delayed + fused"].wgrad_parameters():
        if m.dim() == 2:
            m.main_grad = torch.zeros_like(m, dtype=torch.float32)
    out = {"torch": _timed(lambda: _step(ref, x, dy, call_ref, False), device)}
    for name, m in mods.items():
        out[name] = _timed(lambda m=m, d=name != "immediate": _step(m, x, dy, call, d), device)
    return out


def bench_layernorm_linear(args, device) -> None:
    h, out = args.hidden, 3 * args.hidden
    ref = nn.Sequential(nn.LayerNorm(h), nn.Linear(h, out)).to(device)

    def make(**kw) -> sgm.LayerNormLinear:
        m = sgm.LayerNormLinear(h, out, device=device, **kw)
        m.load_state_dict({
            "layer_norm_weight": ref[0].weight, "layer_norm_bias": ref[0].bias,
            "weight": ref[1].weight, "bias": ref[1].bias,
        })  # fmt: skip
        return m

    x = torch.randn(args.tokens, h, device=device, requires_grad=True)
    dy = torch.randn(args.tokens, out, device=device)
    medians = interleaved_medians(
        _variants(ref, make, lambda m, x: m(x), lambda m, x: m(x), x, dy, device),
        rounds=args.rounds,
        clock=args.clock,
    )
    print_table(f"LayerNormLinear {args.tokens} x {h} -> {out}", medians, "torch")


def bench_layernorm_mlp(args, device) -> None:
    h, f = args.hidden, 4 * args.hidden
    ref = nn.Sequential(nn.LayerNorm(h), nn.Linear(h, f), nn.GELU(approximate="tanh"), nn.Linear(f, h)).to(
        device
    )

    def make(**kw) -> sgm.LayerNormMLP:
        m = sgm.LayerNormMLP(h, f, device=device, **kw)
        m.load_state_dict({
            "layer_norm_weight": ref[0].weight, "layer_norm_bias": ref[0].bias,
            "fc1_weight": ref[1].weight, "fc1_bias": ref[1].bias,
            "fc2_weight": ref[3].weight, "fc2_bias": ref[3].bias,
        })  # fmt: skip
        return m

    x = torch.randn(args.tokens, h, device=device, requires_grad=True)
    dy = torch.randn(args.tokens, h, device=device)
    medians = interleaved_medians(
        _variants(ref, make, lambda m, x: m(x), lambda m, x: m(x), x, dy, device),
        rounds=args.rounds,
        clock=args.clock,
    )
    print_table(f"LayerNormMLP {args.tokens} x {h}, ffn {f}, gelu", medians, "torch")


def bench_grouped_linear(args, device, experts: int) -> None:
    h, out = args.hidden, args.hidden
    splits = [args.tokens // experts] * experts
    splits[-1] += args.tokens - sum(splits)
    ref = nn.ModuleList(nn.Linear(h, out) for _ in range(experts)).to(device)

    def make(**kw) -> sgm.GroupedLinear:
        m = sgm.GroupedLinear(experts, h, out, device=device, **kw)
        state = {}
        for i, lin in enumerate(ref):
            state[f"weight{i}"], state[f"bias{i}"] = lin.weight, lin.bias
        m.load_state_dict(state)
        return m

    def call_ref(m: nn.ModuleList, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([lin(xi) for lin, xi in zip(m, torch.split(x, splits))])

    x = torch.randn(args.tokens, h, device=device, requires_grad=True)
    dy = torch.randn(args.tokens, out, device=device)
    medians = interleaved_medians(
        _variants(ref, make, call_ref, lambda m, x: m(x, splits), x, dy, device),
        rounds=args.rounds,
        clock=args.clock,
    )
    print_table(f"GroupedLinear {experts} experts, {args.tokens} x {h} -> {out}", medians, "torch")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--experts", type=int, nargs="+", default=[4, 32, 128])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall")
    parser.add_argument("--only", choices=["lnlinear", "lnmlp", "grouped"], nargs="*")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    device = torch.device(args.device)
    print(
        f"{device.type}, fp32, {torch.get_num_threads()} threads, {args.rounds} interleaved rounds, "
        f"{args.clock} clock, "
        f"torch {torch.__version__}; medians of forward + backward (+ backward_dw when delayed)"
    )
    only = set(args.only or ["lnlinear", "lnmlp", "grouped"])
    if "lnlinear" in only:
        bench_layernorm_linear(args, device)
    if "lnmlp" in only:
        bench_layernorm_mlp(args, device)
    if "grouped" in only:
        for experts in args.experts:
            bench_grouped_linear(args, device, experts)


if __name__ == "__main__":
    main()
