"""``splitgrad.ops`` MLP vs the ``LayerNormMLP`` module vs plain PyTorch, and each fusion vs its unfused ops.

Run: ``.venv/bin/python benchmarks/bench_ops.py [--tokens 1024 --hidden 256 --ffn 1024 --rounds 30 --threads 1]``

The MLP is ``LayerNorm -> Linear -> GELU(tanh) -> Linear``, forward + backward (+ ``backward_dw`` for the
delayed variants), with the same parameter values everywhere. The ops version should cost what the module and
plain PyTorch cost (target: median ratio <= 1.05): the same kernels run, the fuser adds only Python overhead.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
from torch import nn

import splitgrad
from _timing import interleaved_medians, print_table
from splitgrad import ops
from splitgrad.module.layernorm_mlp import LayerNormMLP


def _step(model: nn.Module, x: torch.Tensor, dy: torch.Tensor, *, drain: bool = False) -> Callable[[], None]:
    params = list(model.parameters())

    def run() -> None:
        for p in params:
            p.grad = None
        model(x).backward(dy)
        if drain:
            splitgrad.backward_dw(model)

    return run


def _forward(model: nn.Module, x: torch.Tensor) -> Callable[[], None]:
    return lambda: model(x)


def _ops_mlp(
    h: int, f: int, *, delay: bool = False, fusions: ops.FusionRegistry | None = None
) -> ops.Sequential:
    return ops.Sequential(
        ops.LayerNorm(h),
        ops.Linear(h, f, delay_wgrad_compute=delay),
        ops.GELU(),
        ops.Linear(f, h, delay_wgrad_compute=delay),
        fusions=fusions,
    )


def bench_mlp(args: argparse.Namespace) -> None:
    h, f = args.hidden, args.ffn
    torch.manual_seed(0)
    plain = nn.Sequential(nn.LayerNorm(h), nn.Linear(h, f), nn.GELU("tanh"), nn.Linear(f, h))
    module = LayerNormMLP(h, f)
    module_delayed = LayerNormMLP(h, f, delay_wgrad_compute=True)
    seq, seq_delayed = _ops_mlp(h, f), _ops_mlp(h, f, delay=True)
    seq_unfused = _ops_mlp(h, f, fusions=ops.FusionRegistry())
    for m in (seq, seq_delayed, seq_unfused):
        m.load_state_dict(plain.state_dict())
    names = ["layer_norm_weight", "layer_norm_bias", "fc1_weight", "fc1_bias", "fc2_weight", "fc2_bias"]
    for m in (module, module_delayed):
        m.load_state_dict(dict(zip(names, plain.state_dict().values())))
    x = torch.randn(args.tokens, h, requires_grad=True)
    dy = torch.randn(args.tokens, h)
    variants = {
        "torch nn.Sequential": _step(plain, x, dy),
        "module LayerNormMLP": _step(module, x, dy),
        "ops Sequential": _step(seq, x, dy),
        "ops Sequential, unfused": _step(seq_unfused, x, dy),
        "module LayerNormMLP, delayed + backward_dw": _step(module_delayed, x, dy, drain=True),
        "ops Sequential, delayed + backward_dw": _step(seq_delayed, x, dy, drain=True),
    }
    med = interleaved_medians(variants, rounds=args.rounds, warmup=2)
    title = (
        f"MLP forward+backward, tokens={args.tokens} hidden={h} ffn={f}, {torch.get_num_threads()} threads"
    )
    print_table(title, med, "torch nn.Sequential")
    o, m, p = med["ops Sequential"], med["module LayerNormMLP"], med["torch nn.Sequential"]
    od, md = med["ops Sequential, delayed + backward_dw"], med["module LayerNormMLP, delayed + backward_dw"]
    print(
        f"\nops / module = {o / m:.3f}   ops / plain torch = {o / p:.3f}   ops delayed / module delayed = {od / md:.3f}"
    )


def bench_fusions(args: argparse.Namespace) -> None:
    h, f = args.hidden, args.ffn
    torch.manual_seed(0)
    x = torch.randn(args.tokens, h, requires_grad=True)
    dy = torch.randn(args.tokens, f)

    def block(fusions: ops.FusionRegistry | None) -> ops.Sequential:
        return ops.Sequential(ops.BasicLinear(h, f), ops.Bias(f), ops.GELU(), fusions=fusions)

    fused, unfused = (
        block(ops.FusionRegistry(forward=[ops.fused.fuse_forward_linear_bias_activation])),
        block(ops.FusionRegistry()),
    )
    unfused.load_state_dict(fused.state_dict())
    med = interleaved_medians(
        {"unfused forward": _forward(unfused, x), "ForwardLinearBiasActivation": _forward(fused, x)},
        rounds=3 * args.rounds,  # cheap, and the effect is a few percent
        warmup=2,
    )
    print_table(f"Forward fusion, forward only (Linear {h}->{f} + Bias + GELU)", med, "unfused forward")

    bwd, none = (
        block(ops.FusionRegistry(backward=[ops.fused.fuse_backward_activation_bias])),
        block(ops.FusionRegistry()),
    )
    none.load_state_dict(bwd.state_dict())
    med = interleaved_medians(
        {"unfused fwd+bwd": _step(none, x, dy), "BackwardActivationBias fwd+bwd": _step(bwd, x, dy)},
        rounds=3 * args.rounds,  # cheap, and the effect is a few percent
        warmup=2,
    )
    print_table("Backward fusion, forward + backward (forward identical in both)", med, "unfused fwd+bwd")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--ffn", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=30)
    # One thread by default: on a shared, loaded CPU two-thread GEMMs straggle and the ratios wander.
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    bench_mlp(args)
    bench_fusions(args)


if __name__ == "__main__":
    main()
