"""Eager vs ``torch.compile`` step time of splitgrad blocks on CPU, per mode (immediate / delayed / fused).

A step is forward + backward (+ ``backward_dw``). 4 residual blocks of ``LayerNormMLP`` (gelu), fp32. Compiled
variants use the default ``torch.compile``; split-mode layers run outside the graph (one break per layer
call), so the compiled graphs hold the residual adds and whatever sits between split layers.

    .venv/bin/python benchmarks/bench_compile.py --rounds 15
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

import splitgrad
from _timing import interleaved_medians, print_table


class Block(nn.Module):
    def __init__(self, hidden: int, ffn: int, **kw: bool) -> None:
        super().__init__()
        self.mlp = splitgrad.LayerNormMLP(hidden, ffn, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(x)


def build(mode: str, hidden: int, ffn: int, blocks: int) -> nn.Module:
    torch.manual_seed(0)
    kw = {"delay_wgrad_compute": mode != "immediate", "fuse_wgrad_accumulation": mode == "fused"}
    model = nn.Sequential(*[Block(hidden, ffn, **kw) for _ in range(blocks)])
    if mode == "fused":
        for layer in splitgrad.split_modules(model):
            for p in layer[1].get_backward_dw_params():
                p.main_grad = torch.zeros_like(p)
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--ffn", type=int, default=1024)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    x = torch.randn(args.tokens, args.hidden)
    variants = {}
    for mode in ("immediate", "delayed", "fused"):
        model = build(mode, args.hidden, args.ffn, args.blocks)
        for kind, run in (("eager", model), ("compiled", torch.compile(model))):

            def step(model: nn.Module = model, run: nn.Module = run) -> None:
                run(x).square().mean().backward()
                splitgrad.backward_dw(model)

            variants[f"{mode}, {kind}"] = step
    medians = interleaved_medians(variants, rounds=args.rounds, warmup=2, clock="wall")
    print_table(
        f"{args.blocks} blocks LayerNormMLP {args.hidden}->{args.ffn}, {args.tokens} tokens, fp32, "
        f"{args.threads} thread(s), median of {args.rounds}",
        medians,
        "immediate, eager",
    )


if __name__ == "__main__":
    main()
