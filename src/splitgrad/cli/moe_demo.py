"""``python -m splitgrad demo --moe --ep 2``: a small MoE GPT trained with expert parallelism.

``--ep`` local gloo ranks each own ``num_experts / ep`` experts of every MoE layer and train on their own
microbatches of the stdlib character corpus (dense gradients averaged over the ranks, expert gradients already
summed over them by the all-to-all backward). Each step runs two microbatches; steps alternate between
running "backward of microbatch 0, forward of microbatch 1" in order and overlapped
(:func:`splitgrad.parallel.expert.overlapped_forward_backward`), so the two orders are timed under the same
conditions. Printed: losses,
the pair's median time in each order, the all-to-all time of the pair, and the fraction of it hidden (the
median over pairs of a sequential step and the overlapped step after it). Written: a Perfetto/Chrome timeline
of the last overlapped step, with compute and communication in separate lanes per rank. For meaningful overlap
figures run it inside a rate-limited namespace (``benchmarks/_netns.py``); on plain loopback gloo's exchanges
are CPU work.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

import splitgrad
from splitgrad.models import MoEConfig, lm_loss, load_char_corpus, moe_layers
from splitgrad.parallel.expert import ExpertParallelMoEGPT, overlapped_forward_backward
from splitgrad.pipeline.timeline import TimelineEvent, to_chrome_trace
from splitgrad.testing import spawn

__all__ = ["run_moe"]

logger = logging.getLogger(__name__)


def _pair(
    model: torch.nn.Module,
    ids: torch.Tensor,
    targets: torch.Tensor,
    mb: int,
    overlapped: bool,
    group: dist.ProcessGroup,
) -> tuple[torch.Tensor, tuple[float, float, float, float]]:
    """One step of two microbatches ``ids: (2 * mb, seq)``: ``F0``, then ``B0 ‖ F1`` (interleaved on one thread)
    or ``B0; F1``, ``B1``, ``backward_dw``. Returns the summed loss (detached) and the times before ``F0``,
    after ``F0``, after the pair and at the end (``time.perf_counter()``)."""
    dist.barrier(group)
    t0 = time.perf_counter()
    loss0 = lm_loss(model(ids[:mb]), targets[:mb]) / 2
    t1 = time.perf_counter()
    if overlapped:
        logits1 = overlapped_forward_backward(model, ids[mb:], loss0)
    else:
        loss0.backward()
        logits1 = model(ids[mb:])
    t2 = time.perf_counter()
    loss1 = lm_loss(logits1, targets[mb:]) / 2
    loss1.backward()
    splitgrad.backward_dw(model)
    return (loss0 + loss1).detach(), (t0, t1, t2, time.perf_counter())


def _rank(rank: int, world: int, opts: dict) -> dict:
    group = dist.new_group(list(range(world)))
    corpus = load_char_corpus(opts["seq_len"], max_chars=opts["max_chars"])
    config = MoEConfig(
        vocab_size=corpus.tokenizer.vocab_size, seq_len=opts["seq_len"], hidden_size=opts["hidden_size"],
        num_layers=opts["num_layers"], num_heads=opts["num_heads"], num_experts=4 * world, top_k=2,
        delay_wgrad_compute=True,
    )  # fmt: skip
    torch.manual_seed(opts["seed"])  # the same dense weights on every rank
    model = ExpertParallelMoEGPT(config, ep_group=group)
    for i, layer in enumerate(moe_layers(model)):
        torch.manual_seed(opts["seed"] + 1 + 1000 * rank + i)  # different experts on different ranks
        layer.fc1.reset_parameters()
        layer.fc2.reset_parameters()
    log: list = []
    wlog: list = []
    for layer in moe_layers(model):
        layer.comm_log, layer.wgrad_log = log, wlog
    opt = torch.optim.AdamW(model.parameters(), lr=opts["lr"])
    gen = torch.Generator().manual_seed(opts["seed"] + 7 * rank)
    mb = opts["batch_size"] // 2
    times: dict[str, list[float]] = {"sequential": [], "overlapped": []}
    comm: list[float] = []
    losses, events, check = [], [], {}
    for step in range(opts["steps"]):
        ids, targets = corpus.train.get_batch(2 * mb, generator=gen)
        variant = "overlapped" if step % 2 else "sequential"
        if step == 0:
            # The two orders on the same weights and batch: losses and gradients must be bit-for-bit equal.
            seq_loss, _ = _pair(model, ids, targets, mb, False, group)
            seq_grads = [p.grad.clone() for p in model.parameters()]
            model.zero_grad(set_to_none=True)
            check = {"sequential": seq_loss}
        log.clear()
        wlog.clear()
        overlapped = variant == "overlapped" or step == 0
        loss, (t0, t1, t2, t3) = _pair(model, ids, targets, mb, overlapped, group)
        if step == 0:
            check["overlapped"] = loss
            check["grads_equal"] = all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), seq_grads))
        pair_comm = sum(end - start for name, start, end in log if start >= t1 and end <= t2)
        for p in model.parameters():
            if not getattr(p, "expert_parallel", False):
                dist.all_reduce(p.grad, group=group)
                p.grad /= world
        opt.step()
        opt.zero_grad(set_to_none=True)
        total = loss.reshape(1).clone()
        dist.all_reduce(total, group=group)
        losses.append(float(total) / world)
        if step >= 2:  # the first steps set up connections
            times[variant].append(t2 - t1)
            if variant == "sequential":
                comm.append(pair_comm)
        if variant == "overlapped" and step > 0:
            events = [
                TimelineEvent(rank, "forward mb0", t0 - t0, t1 - t0, "F", 0, 0),
                TimelineEvent(rank, "B mb0 || F mb1", t1 - t0, t2 - t0, "FB", 0, 1),
                TimelineEvent(rank, "backward mb1 + backward_dw", t2 - t0, t3 - t0, "BW", 0, 1),
            ]
            events += [TimelineEvent(rank, name, s - t0, e - t0, "comm") for name, s, e in log]
            events += [
                TimelineEvent(rank, "expert W (in dispatch bwd)", s - t0, e - t0, "W") for _, s, e in wlog
            ]
    return {"losses": losses, "times": times, "comm": comm, "events": events, "check": check}


def run_moe(args: argparse.Namespace) -> int:
    """Spawn ``args.ep`` ranks, train, print the overlap table, write the timeline; returns an exit code."""
    if args.ep < 2:
        args.usage_error(f"--ep must be at least 2, got {args.ep}")
    opts = {
        "seq_len": min(args.seq_len, 128), "hidden_size": args.hidden_size, "num_layers": args.num_layers,
        "num_heads": args.num_heads, "max_chars": args.max_chars, "seed": args.seed, "lr": args.lr,
        "steps": max(args.steps, 6), "batch_size": max(2, args.batch_size - args.batch_size % 2),
    }  # fmt: skip
    print(
        f"splitgrad demo --moe: {args.ep} expert-parallel ranks, {4 * args.ep} experts, {opts['steps']} steps"
    )
    results = spawn(
        _rank, args.ep, opts, timeout=args.timeout * 10, pg_timeout=args.timeout, threads=args.threads
    )
    r0 = results[0]
    same = all(r["check"]["sequential"].item() == r["check"]["overlapped"].item() for r in results)
    grads = all(r["check"]["grads_equal"] for r in results)
    print(
        f"order check (step 0, same weights and batch, rank 0): loss sequential {r0['check']['sequential'].item()!r} "
        f"overlapped {r0['check']['overlapped'].item()!r}; losses bitwise equal on every rank: "
        f"{'yes' if same else 'NO'}; gradients bitwise equal on every rank: {'yes' if grads else 'NO'}"
    )
    for step in range(0, len(r0["losses"]), max(1, len(r0["losses"]) // 5)):
        print(f"step {step:3d}  loss {r0['losses'][step]:.4f}")
    seq = statistics.median(r0["times"]["sequential"])
    ovl = statistics.median(r0["times"]["overlapped"])
    comm = statistics.median(r0["comm"])
    # Each sequential step and the overlapped step right after it form a pair: the median of the pairs'
    # hidden fractions, so that drift between steps cancels.
    hidden = statistics.median(
        (s - o) / c for s, o, c in zip(r0["times"]["sequential"], r0["times"]["overlapped"], r0["comm"])
    )
    print("| order | pair B0 + F1 (ms) |\n|---|---:|")
    print(f"| sequential | {seq * 1e3:.1f} |\n| overlapped | {ovl * 1e3:.1f} |")
    print(
        f"all-to-all time in the sequential pair {comm * 1e3:.1f} ms; hidden by the overlapped order: "
        f"{hidden:.0%} (median over step pairs; the compute could cover at most {min(comm, seq - comm) / comm:.0%})"
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    events = [e for r in results for e in r["events"]]
    path = out / f"timeline_moe_ep{args.ep}.json"
    path.write_text(json.dumps(to_chrome_trace(events, us_per_unit=1e6, process_name="splitgrad MoE EP")))
    print(f"wrote {path} (compute and communication lanes per rank; open in Perfetto / chrome://tracing)")
    if not (same and grads):
        print("error: the overlapped order did not reproduce the sequential order bit for bit")
        return 1
    return 0
