"""``python -m splitgrad split``: the dgrad/wgrad split on a small model, with measured figures.

Trains a small MLP of ``splitgrad.Linear`` layers for a few steps twice — immediate and with deferred wgrad —
and prints, per step, the time of the dgrad-only backward and of the deferred W step, checks the two runs'
parameters are bitwise equal, and shows the optimizer guard refusing a step with wgrad work pending.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

import splitgrad

from ._demo_checks import positive_int

__all__ = ["add_parser", "run"]


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "split",
        help="show the dgrad/wgrad split on one process (no pipeline)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    # A bad count is argparse's one-line error (exit 2), not a traceback from inside torch.
    parser.add_argument("--steps", type=positive_int, default=5, help="training steps per run")
    parser.add_argument("--hidden", type=positive_int, default=1024, help="hidden size of the MLP")
    parser.add_argument("--tokens", type=positive_int, default=2048, help="tokens per step")
    parser.set_defaults(func=run)


def _mlp(hidden: int, delay: bool) -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(4):
        layers += [splitgrad.Linear(hidden, hidden, delay_wgrad_compute=delay), nn.GELU()]
    return nn.Sequential(*layers)


def _train(args: argparse.Namespace, delay: bool) -> tuple[nn.Module, list[tuple[float, float, float]]]:
    model = _mlp(args.hidden, delay)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    splitgrad.guard_optimizer(opt, model)
    gen = torch.Generator().manual_seed(1)
    timings = []
    for _ in range(args.steps):
        x = torch.randn(args.tokens, args.hidden, generator=gen)
        loss = model(x).square().mean()
        t0 = time.perf_counter()
        loss.backward()
        t1 = time.perf_counter()
        splitgrad.backward_dw(model)  # no-op when nothing was deferred
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad()
        timings.append((float(loss.detach()), t1 - t0, t2 - t1))
    return model, timings


def run(args: argparse.Namespace) -> int:
    print(f"4 x splitgrad.Linear({args.hidden}, {args.hidden}) + GELU, {args.tokens} tokens/step, fp32 CPU")
    ref, ref_t = _train(args, delay=False)
    split, split_t = _train(args, delay=True)
    print(f"{'step':>4} {'loss':>10} | {'immediate bwd ms':>16} | {'dgrad-only bwd ms':>17} {'W step ms':>9}")
    for i, ((loss, b0, _), (_, b1, w1)) in enumerate(zip(ref_t, split_t)):
        print(f"{i:>4} {loss:>10.6f} | {b0 * 1e3:>16.1f} | {b1 * 1e3:>17.1f} {w1 * 1e3:>9.1f}")
    same = all(torch.equal(a, b) for a, b in zip(ref.parameters(), split.parameters()))
    print(f"parameters after {args.steps} steps bitwise equal (immediate vs deferred): {same}")

    opt = torch.optim.SGD(split.parameters(), lr=1e-3)
    splitgrad.guard_optimizer(opt, split)
    split(torch.randn(4, args.hidden)).sum().backward()
    print(f"pending wgrad tasks after a backward: {splitgrad.pending_wgrad(split)}")
    try:
        opt.step()
    except RuntimeError as err:
        print(f"optimizer.step() refused: {str(err)[:90]}...")
    print(f"backward_dw drained {splitgrad.backward_dw(split)} task(s); step allowed")
    opt.step()
    return 0 if same else 1
