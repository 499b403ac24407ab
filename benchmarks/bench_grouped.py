"""Grouped expert GEMMs: splitgrad's GroupedLinear and converted HF experts vs a loop of nn.Linear and vs
transformers' own ``grouped_mm`` experts path. Forward + backward (+ ``backward_dw``), medians of interleaved rounds.

Run: ``.venv/bin/python benchmarks/bench_grouped.py [--quick] [--experts 8 32 128] [--dtypes float32 bfloat16]``

Two tables per dtype and expert count:

* **layer**: one grouped linear ``(tokens, H) -> (tokens, H)`` over ``E`` experts, tokens spread at random:
  a loop of ``nn.Linear`` (``split -> linear -> cat``, the baseline), ``splitgrad.GroupedLinear`` with one weight
  per expert and with one 3-D weight (``single_grouped_weight``), both deferring the wgrad to ``backward_dw``.
* **experts**: a HuggingFace ``MixtralExperts`` layer (gate/up, SiLU gate, down, top-2 routing) run by
  transformers' ``grouped_mm`` implementation (the baseline) and the same layer after ``splitgrad.convert``
  (deferred, drained by ``backward_dw``).

Targets: layer <= 1.00x the loop, experts <= 1.05x transformers. One thread and the process CPU clock by
default (a shared machine's wall time mostly measures the neighbours). ``--quick`` is a smoke run.
"""

from __future__ import annotations

import argparse
import copy
from collections.abc import Callable

import torch
from torch import nn

import splitgrad
from _timing import CLOCKS, interleaved_medians, print_table


def _layer_variants(
    experts: int, tokens: int, hidden: int, dtype: torch.dtype
) -> dict[str, Callable[[], None]]:
    gen = torch.Generator().manual_seed(0)
    counts = torch.bincount(torch.randint(0, experts, (tokens,), generator=gen), minlength=experts).tolist()
    x = torch.randn(tokens, hidden, generator=gen).to(dtype).requires_grad_()
    dy = torch.randn(tokens, hidden, generator=gen).to(dtype)
    loop = nn.ModuleList(nn.Linear(hidden, hidden, bias=False, dtype=dtype) for _ in range(experts))
    kw = {"bias": False, "params_dtype": dtype, "delay_wgrad_compute": True}
    separate = splitgrad.GroupedLinear(experts, hidden, hidden, **kw)
    single = splitgrad.GroupedLinear(experts, hidden, hidden, single_grouped_weight=True, **kw)

    def run_loop() -> None:
        loop.zero_grad(set_to_none=True)
        x.grad = None
        torch.cat([lin(part) for lin, part in zip(loop, x.split(counts))]).backward(dy)

    def run(layer: splitgrad.GroupedLinear) -> Callable[[], None]:
        def step() -> None:
            layer.zero_grad(set_to_none=True)
            x.grad = None
            layer(x, counts).backward(dy)
            layer.backward_dw()

        return step

    return {
        "loop of nn.Linear": run_loop,
        "GroupedLinear (weight0..)": run(separate),
        "GroupedLinear (single weight)": run(single),
    }


def _experts_variants(
    experts: int, tokens: int, hidden: int, dtype: torch.dtype
) -> dict[str, Callable[[], None]]:
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    config = MixtralConfig(hidden_size=hidden, intermediate_size=hidden, num_local_experts=experts)
    config._experts_implementation = "grouped_mm"
    torch.manual_seed(0)
    hf = MixtralExperts(config).to(dtype)
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(std=0.02)
    ours = splitgrad.convert(copy.deepcopy(hf))
    gen = torch.Generator().manual_seed(1)
    h = torch.randn(tokens, hidden, generator=gen).to(dtype).requires_grad_()
    ids = torch.rand(tokens, experts, generator=gen).topk(2, dim=-1).indices
    weights = torch.rand(tokens, 2, generator=gen).softmax(-1).to(dtype)
    dy = torch.randn(tokens, hidden, generator=gen).to(dtype)

    def run(layer: nn.Module, drain: bool) -> Callable[[], None]:
        def step() -> None:
            layer.zero_grad(set_to_none=True)
            h.grad = None
            layer(h, ids, weights).backward(dy)
            if drain:
                layer.backward_dw()

        return step

    with torch.no_grad():  # the two paths agree before anything is timed
        torch.testing.assert_close(ours(h, ids, weights), hf(h, ids, weights), rtol=2e-2, atol=1e-3)
    return {"transformers grouped_mm": run(hf, False), "splitgrad (deferred + backward_dw)": run(ours, True)}


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
    parser.add_argument("--rounds", type=int, default=7)
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
    print(
        f"tokens={args.tokens} hidden={args.hidden} rounds={args.rounds} threads={args.threads} clock={args.clock}"
    )
    for name in args.dtypes:
        dtype = getattr(torch, name)
        for experts in args.experts:
            shape = f"{name}, {experts} experts, {args.tokens} tokens, hidden {args.hidden}"
            for table in args.tables:
                make, baseline, title = TABLES[table]
                medians = interleaved_medians(
                    make(experts, args.tokens, args.hidden, dtype), rounds=args.rounds, clock=args.clock
                )
                print_table(f"{title}: {shape}", medians, baseline)


if __name__ == "__main__":
    main()
