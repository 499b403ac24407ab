"""splitgrad.Linear vs torch.nn.Linear, forward + backward (+ backward_dw), in one process.

Run: ``.venv/bin/python benchmarks/bench_linear.py [--tokens 4096 --in 1024 --out 4096 --rounds 15]``

The same three GEMMs run in every variant, so the ideal ratio is 1.00; the fused variant's memory claim is
checked by counting allocations (no weight-sized temporary), not by timing.
"""

from __future__ import annotations

import argparse

import torch

import splitgrad
from _timing import CLOCKS, interleaved_medians, print_table
from splitgrad.testing.memory import AllocationTracker


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--in-features", "--in", dest="in_features", type=int, default=1024)
    parser.add_argument("--out-features", "--out", dest="out_features", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument(
        "--clock", choices=sorted(CLOCKS), default="wall", help="cpu: process time (use 1 thread)"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    ref = torch.nn.Linear(args.in_features, args.out_features)
    immediate = splitgrad.Linear(args.in_features, args.out_features)
    delayed = splitgrad.Linear(args.in_features, args.out_features, delay_wgrad_compute=True)
    fused = splitgrad.Linear(
        args.in_features, args.out_features, delay_wgrad_compute=True, fuse_wgrad_accumulation=True
    )
    for m in (immediate, delayed, fused):
        m.load_state_dict(ref.state_dict())
    fused.weight.main_grad = torch.zeros_like(fused.weight, dtype=torch.float32)
    x = torch.randn(args.tokens, args.in_features, requires_grad=True)
    dy = torch.randn(args.tokens, args.out_features)

    def step(module: torch.nn.Module, drain: bool) -> None:
        module.zero_grad(set_to_none=False)
        x.grad = None
        module(x).backward(dy)
        if drain:
            module.backward_dw()

    medians = interleaved_medians(
        {
            "torch.nn.Linear": lambda: step(ref, False),
            "splitgrad immediate": lambda: step(immediate, False),
            "splitgrad delayed (bwd + backward_dw)": lambda: step(delayed, True),
            "splitgrad delayed + fused main_grad": lambda: step(fused, True),
        },
        rounds=args.rounds,
        clock=args.clock,
    )

    fused(x).backward(dy)
    with AllocationTracker() as tracker:
        fused.backward_dw()
    weight_mib = fused.weight.numel() * fused.weight.element_size() / 2**20
    print(
        f"Linear {args.tokens} tokens x {args.in_features} -> {args.out_features}, fp32, "
        f"{torch.get_num_threads()} threads, {args.clock} clock, {args.rounds} interleaved rounds, "
        f"torch {torch.__version__}"
    )
    print_table("forward + backward (+ backward_dw)", medians, "torch.nn.Linear")
    print(
        f"\nfused backward_dw: largest new allocation {tracker.largest_bytes / 2**20:.2f} MiB, "
        f"total {tracker.total_bytes / 2**20:.2f} MiB (weight is {weight_mib:.1f} MiB)"
    )


if __name__ == "__main__":
    main()
