"""Training-step time of a small GPT layer stack: eager splitgrad vs graphed (forward, backward, wgrad graphs).

Both variants run the same blocks (``splitgrad.models.GPT`` blocks, ``delay_wgrad_compute=True``): forward
through every block, backward of a squared-sum loss, then the deferred weight gradients — ``backward_dw`` of
each block eagerly, ``GraphedCallable.backward_dw()`` (wgrad-graph replay + hooks) graphed. One wgrad hook per
layer counts fires, so the graphed step pays for the hook calls it must make.

On CUDA the graphed variant uses real CUDA graphs. On CPU it uses the *stand-in* backend, which replays aten
ops one Python call at a time: that number measures the stand-in, not CUDA graphs, and the table says so.

Before timing, one step of each is compared (outputs and every gradient) so a fast wrong variant cannot win.

Run: ``.venv/bin/python benchmarks/bench_graphs.py`` (CPU, stand-in) or
``python benchmarks/bench_graphs.py --device cuda --out bench_graphs.json`` on a GPU machine.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import splitgrad
from _timing import CLOCKS, interleaved_medians, print_table
from splitgrad.graphs import make_graphed_callables
from splitgrad.models import GPT, GPTConfig
from splitgrad.testing import CpuGraphBackend


def build_blocks(args: argparse.Namespace, device: torch.device) -> torch.nn.ModuleList:
    torch.manual_seed(0)
    config = GPTConfig(
        vocab_size=64,
        seq_len=args.seq,
        hidden_size=args.hidden,
        num_heads=args.heads,
        num_layers=args.layers,
        delay_wgrad_compute=True,
    )
    return GPT(config, device=device).blocks


def count_fires(blocks: torch.nn.ModuleList) -> list[int]:
    fires = [0]

    def hook() -> None:
        fires[0] += 1

    for _, module in splitgrad.split_modules(blocks):
        module.register_wgrad_accumulation_and_reduce_hooks(hook)
    return fires


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=None, help="default: 256 on CUDA, 64 on CPU")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=None, help="default: 128 on CUDA, 32 on CPU")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=None, help="default: 200 on CUDA, 20 on CPU")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads (1: steadiest timings)")
    parser.add_argument(
        "--clock",
        choices=sorted(CLOCKS),
        default=None,
        help="default: wall on CUDA, cpu (process time) on CPU",
    )
    parser.add_argument("--out", default=None, help="also write the figures as JSON here")
    args = parser.parse_args()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    args.hidden = args.hidden or (256 if cuda else 64)
    args.seq = args.seq or (128 if cuda else 32)
    args.rounds = args.rounds or (200 if cuda else 20)
    args.clock = args.clock or ("wall" if cuda else "cpu")
    torch.set_num_threads(args.threads)

    eager, model = build_blocks(args, device), build_blocks(args, device)
    fires_eager, fires_graphed = count_fires(eager), count_fires(model)
    shape = (args.batch, args.seq, args.hidden)
    samples = tuple((torch.randn(shape, device=device, requires_grad=True),) for _ in model)
    start = time.perf_counter()
    # Timing the stand-in: skip its shared-pool emulation (it scribbles NaN over later graphs' memory).
    backend = "cuda" if cuda else CpuGraphBackend(shared_pool=False)
    graphed = make_graphed_callables(tuple(model), samples, backend=backend)
    capture_s = time.perf_counter() - start
    graph_type = type(graphed[0].graphs["forward"]).__name__
    x = torch.randn(shape, device=device)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    def eager_step() -> None:
        h = x.detach().requires_grad_()
        for block in eager:
            h = block(h)
        h.square().sum().backward()
        for block in reversed(eager):
            splitgrad.backward_dw(block)
        sync()

    def graphed_step() -> None:
        h = x.detach().requires_grad_()
        for g in graphed:
            h = g(h)
        h.square().sum().backward()
        for g in reversed(graphed):
            g.backward_dw()
        sync()

    # Correctness first: one step each from zeroed gradients must agree.
    for m in (eager, model):
        m.zero_grad(set_to_none=True)
    eager_step()
    graphed_step()
    tol = {"rtol": 1e-4, "atol": 1e-5} if cuda else {"rtol": 0.0, "atol": 0.0}
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, **tol, msg=lambda m, name=name: f"{name}: {m}")
    if fires_eager != fires_graphed:
        raise RuntimeError(f"hook fires differ: eager {fires_eager[0]}, graphed {fires_graphed[0]}")

    medians = interleaved_medians(
        {"eager": eager_step, "graphed": graphed_step}, rounds=args.rounds, warmup=3, clock=args.clock
    )
    label = "graphed (CUDA graphs)" if cuda else "graphed (CPU stand-in, not CUDA-graph speed)"
    ops = (
        {k: getattr(g, "num_ops", None) for k, g in graphed[0].graphs.items()}
        if graph_type == "CpuGraph"
        else {}
    )
    print_table(
        f"GPT block stack, {args.layers} layers, x={shape}, {device}, backend {graph_type}, {args.clock} clock, "
        f"capture {capture_s:.2f}s" + (f", aten ops per layer graph {ops}" if ops else ""),
        {"eager": medians["eager"], label: medians["graphed"]},
        baseline="eager",
    )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {
                    "device": str(device),
                    "device_name": torch.cuda.get_device_name(device) if cuda else "cpu",
                    "torch": torch.__version__,
                    "backend": graph_type,
                    "shape": shape,
                    "layers": args.layers,
                    "rounds": args.rounds,
                    "clock": args.clock,
                    "capture_s": capture_s,
                    "eager_ms": medians["eager"] * 1e3,
                    "graphed_ms": medians["graphed"] * 1e3,
                    "ratio": medians["graphed"] / medians["eager"],
                },
                f,
                indent=2,
            )


if __name__ == "__main__":
    main()
