"""Grouped expert GEMMs: splitgrad's GroupedLinear and converted HF experts vs a loop of nn.Linear and vs
transformers' own ``grouped_mm`` experts path. Forward + backward (+ ``backward_dw``), ratios paired by round.

Run: ``.venv/bin/python benchmarks/bench_grouped.py [--quick] [--experts 8 32 128] [--dtypes float32 bfloat16]``

Two tables per dtype and expert count:

* **layer**: one grouped linear ``(tokens, H) -> (tokens, H)`` over ``E`` experts, tokens spread at random:
  a loop of ``nn.Linear`` (``split -> linear -> cat``, the baseline), the same loop of deferring
  ``splitgrad.Linear`` (what deferral alone costs), ``splitgrad.GroupedLinear`` with one weight
  per expert (``weight0..``) and with one 3-D weight (``single_grouped_weight``), each immediate and deferred
  (wgrad in ``backward_dw``), and the single weight deferred into a kept ``main_grad`` (zeroed each step, as
  Megatron-Core's DDP zeroes its buffers), which allocates no gradient at all.
* **experts**: a HuggingFace ``MixtralExperts`` layer (gate/up, SiLU gate, down, top-2 routing) run by
  transformers' ``grouped_mm`` implementation (the baseline) and the same layer after ``splitgrad.convert``,
  immediate and deferred (drained by ``backward_dw``).

Each round runs every variant once (order reversed every other round); a variant's ratio is the median over
rounds of its time / the baseline's time in the same round, with quartiles. The last column counts the page
faults per call: glibc ``mmap``s every allocation of 32 MiB or more afresh, and the kernel maps and zeroes it
page by page on first touch. That cost follows the layout (one ``(E, out, in)`` gradient against ``E`` small
ones), not the GEMMs; the header says which allocator settings the run had (docs/hf_moe.md#benchmark).

Targets: layer <= 1.00x the loop, experts <= 1.05x transformers. One thread and the process CPU clock by
default (a shared machine's wall time mostly measures the neighbours). ``--quick`` is a smoke run.
"""

from __future__ import annotations

import argparse
import copy
import os
from collections.abc import Callable

import torch
from torch import nn

import splitgrad
from _timing import CLOCKS, interleaved_samples, print_paired_table

#: glibc's allocator settings that decide whether freed memory goes back to the kernel (read at start-up).
ALLOCATOR_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "LD_PRELOAD")


def _layer_variants(
    experts: int, tokens: int, hidden: int, dtype: torch.dtype
) -> dict[str, Callable[[], None]]:
    gen = torch.Generator().manual_seed(0)
    counts = torch.bincount(torch.randint(0, experts, (tokens,), generator=gen), minlength=experts).tolist()
    x = torch.randn(tokens, hidden, generator=gen).to(dtype).requires_grad_()
    dy = torch.randn(tokens, hidden, generator=gen).to(dtype)
    loop = nn.ModuleList(nn.Linear(hidden, hidden, bias=False, dtype=dtype) for _ in range(experts))
    deferred_loop = nn.ModuleList(
        splitgrad.Linear(hidden, hidden, bias=False, params_dtype=dtype, delay_wgrad_compute=True)
        for _ in range(experts)
    )

    def grouped(single: bool, delay: bool, fused: bool = False) -> splitgrad.GroupedLinear:
        return splitgrad.GroupedLinear(
            experts, hidden, hidden, bias=False, params_dtype=dtype, single_grouped_weight=single,
            delay_wgrad_compute=delay, fuse_wgrad_accumulation=fused,
        )  # fmt: skip

    def run_loop(linears: nn.ModuleList, *, drain: bool = False) -> Callable[[], None]:
        def step() -> None:
            linears.zero_grad(set_to_none=True)
            x.grad = None
            torch.cat([lin(part) for lin, part in zip(linears, x.split(counts))]).backward(dy)
            if drain:
                for lin in linears:
                    lin.backward_dw()

        return step

    def run(layer: splitgrad.GroupedLinear) -> Callable[[], None]:
        kept = [p.main_grad for p in layer.parameters() if hasattr(p, "main_grad")]

        def step() -> None:
            layer.zero_grad(set_to_none=True)
            for buffer in kept:
                buffer.zero_()
            x.grad = None
            layer(x, counts).backward(dy)
            if layer.need_backward_dw():
                layer.backward_dw()

        return step

    into_main_grad = grouped(True, True, fused=True)
    into_main_grad.weight.main_grad = torch.zeros_like(into_main_grad.weight)
    return {
        "loop of nn.Linear": run_loop(loop),
        "loop of splitgrad.Linear, deferred": run_loop(deferred_loop, drain=True),
        "weight0.., immediate": run(grouped(False, False)),
        "weight0.., deferred": run(grouped(False, True)),
        "single weight, immediate": run(grouped(True, False)),
        "single weight, deferred": run(grouped(True, True)),
        "single weight, deferred into main_grad": run(into_main_grad),
    }


def _experts_variants(
    experts: int, tokens: int, hidden: int, dtype: torch.dtype
) -> dict[str, Callable[[], None]]:
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    from splitgrad.integrations.transformers import convert_experts

    config = MixtralConfig(hidden_size=hidden, intermediate_size=hidden, num_local_experts=experts)
    config._experts_implementation = "grouped_mm"
    torch.manual_seed(0)
    hf = MixtralExperts(config).to(dtype)
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(std=0.02)
    deferred = splitgrad.convert(copy.deepcopy(hf))
    immediate = copy.deepcopy(hf)
    convert_experts(immediate, delay_wgrad_compute=False)
    gen = torch.Generator().manual_seed(1)
    h = torch.randn(tokens, hidden, generator=gen).to(dtype).requires_grad_()
    ids = torch.rand(tokens, experts, generator=gen).topk(2, dim=-1).indices
    weights = torch.rand(tokens, 2, generator=gen).softmax(-1).to(dtype)
    dy = torch.randn(tokens, hidden, generator=gen).to(dtype)

    def run(layer: nn.Module) -> Callable[[], None]:
        drain = getattr(layer, "need_backward_dw", lambda: False)

        def step() -> None:
            layer.zero_grad(set_to_none=True)
            h.grad = None
            layer(h, ids, weights).backward(dy)
            if drain():
                layer.backward_dw()

        return step

    with torch.no_grad():  # the two paths agree before anything is timed
        torch.testing.assert_close(deferred(h, ids, weights), hf(h, ids, weights), rtol=2e-2, atol=1e-3)
    return {
        "transformers grouped_mm": run(hf),
        "splitgrad, immediate": run(immediate),
        "splitgrad, deferred + backward_dw": run(deferred),
    }


#: table -> (variants builder, baseline variant, title)
TABLES = {
    "layer": (_layer_variants, "loop of nn.Linear", "layer"),
    "experts": (_experts_variants, "transformers grouped_mm", "experts (MixtralExperts, top-2)"),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, nargs="+", default=[8, 32, 128])
    parser.add_argument(
        "--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"]
    )
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="cpu")
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: tiny sizes, 2 rounds, 8 and 32 experts"
    )
    parser.add_argument("--tables", nargs="+", default=["layer", "experts"], choices=sorted(TABLES))
    args = parser.parse_args()
    if args.quick:
        args.tokens, args.hidden, args.rounds, args.experts = 256, 64, 2, [8, 32]
    torch.set_num_threads(args.threads)
    allocator = [f"{k}={os.environ[k]}" for k in ALLOCATOR_SETTINGS if k in os.environ]
    print(
        f"tokens={args.tokens} hidden={args.hidden} rounds={args.rounds} threads={args.threads} clock={args.clock}; "
        f"allocator: {' '.join(allocator) or 'glibc defaults'}; torch {torch.__version__}"
    )
    for name in args.dtypes:
        dtype = getattr(torch, name)
        for experts in args.experts:
            shape = f"{name}, {experts} experts, {args.tokens} tokens, hidden {args.hidden}"
            for table in args.tables:
                make, baseline, title = TABLES[table]
                samples = interleaved_samples(
                    make(experts, args.tokens, args.hidden, dtype), rounds=args.rounds, clock=args.clock
                )
                print_paired_table(f"{title}: {shape}", samples, baseline)


if __name__ == "__main__":
    main()
