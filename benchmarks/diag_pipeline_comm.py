"""Where a splitgrad pipeline step loses time to its transport, with load-independent evidence.

Run: ``.venv/bin/python benchmarks/diag_pipeline_comm.py [--schedule zbv] [--quick] [--steps 4] [--3d]`` (the
model and data of ``bench_pipeline.py``, 2-D activations or with ``--3d`` 3-D; on a shared machine wrap it in
``benchmarks/_netns.py``).

Wall-clock waits on a loaded machine mix transport with a producer that was simply late (descheduled), so
besides the measured and simulated bubbles and :func:`~splitgrad.pipeline.timeline.idle_breakdown`, each
receive of the last step is split using the per-step :class:`~splitgrad.pipeline.runtime.comm.CommStats` of
both ranks (``time.perf_counter`` is one clock for every process of a host):

* ``lead``: how long before its action needed it the receive was posted (0: posted at the need);
* ``late``: how long the action waited because the peer had not posted the send yet (the producer's
  lateness: load or schedule, not transport);
* ``moved``: the rest of the wait, from the moment both ends had posted until the data was in hand
  (transport: header round trips, a receive posted too late, the copy itself).

Also per rank: CPU seconds of the step (``time.process_time``) next to its span, the runtime's own CPU per
action outside the handlers (``StepResult.runtime_cpu``), how long the runtime's thread waited on the run queue
(runnable but descheduled: ``/proc`` schedstat, Linux; in all and between actions, where it adds to
``dispatch``), shape headers exchanged, receives posted ahead, sends released early, and the peak bytes of
receive buffers and unconfirmed sends held.

And per step and rank, the step replayed at its own per-action durations
(:func:`splitgrad.pipeline.timeline.replay_measured`, the simulator's engine) and
:func:`~splitgrad.pipeline.timeline.overhead_split`: measured span - replay span = dispatch (idle with every input
produced, no receive running: Python between actions) + transport (in a receive wait after the producer had
finished) + propagated (waiting beyond the replay's for a producer delayed on its own rank).
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import asdict

import torch.nn.functional as F

from _pipeline_variants import BenchConfig, batch, cut
from _schedstat import HandlerRunQueue
from splitgrad.pipeline.runtime import build_runtime
from splitgrad.pipeline.runtime.recording import gather_events
from splitgrad.pipeline.timeline import (
    idle_breakdown,
    measured_bubble_ratio,
    overhead_split,
    replay_measured,
    simulate_measured,
)
from splitgrad.testing import spawn


def run_rank(
    rank: int, world: int, cfg_fields: dict, schedule: str, steps: int, depth: int, reset: bool, three_d: bool
) -> dict:
    cfg = BenchConfig(**cfg_fields)
    n_stages = 4 if schedule.startswith("zbv") else 2
    rt = build_runtime(
        cut(cfg, True, n_stages),
        schedule,
        loss_fn=F.mse_loss,
        n_microbatches=cfg.n_microbatches,
        prefetch_depth=depth,
    )
    x, y = batch(cfg, three_d)
    run_queue = HandlerRunQueue(rt)
    out: dict = {"steps": []}
    for _ in range(steps):
        rt.zero_grad()
        if reset:  # the protocol before shapes were agreed once: headers on every step
            rt.reset_shapes()
        cpu = time.process_time()
        result, queued, queued_inside = run_queue.step(lambda: rt.step(x, y))
        cpu = time.process_time() - cpu
        events = gather_events(result.events, dst=0)
        stats = result.comm
        out["steps"].append(
            {
                "cpu": cpu,
                "runtime_cpu": result.runtime_cpu,
                "run_queue": (queued, queued_inside),
                "actions": len(rt.actions),
                "events": events,
                "bubble": None if events is None else measured_bubble_ratio(events),
                "simulated": None if events is None else simulate_measured(events, rt.schedule).bubble_ratio,
                "idle": None if events is None else idle_breakdown(events),
                "replay": None if events is None else replay_measured(events, rt.schedule).bubble_ratio,
                "split": None if events is None else overhead_split(events, rt.schedule),
                "receives": [(r.label, r.posted, r.needed, r.done, r.tag) for r in stats.receives],
                "send_posted": dict(stats.send_posted),
                "counts": {
                    "headers": stats.headers,
                    "posted ahead": f"{stats.posted_ahead}/{len(stats.receives)}",
                    "released early": stats.released_early,
                    "peak recv MiB": round(stats.peak_recv_bytes / 2**20, 2),
                    "peak send MiB": round(stats.peak_send_bytes / 2**20, 2),
                },
            }
        )
    rt.close()
    return out


def split_waits(mine: dict, peer: dict) -> list[tuple[str, float, float, float, float, bool]]:
    """Per receive of ``mine``: ``(label, lead, wait, late, moved)`` in ms (see the module docstring) and
    whether the receive was posted before the peer posted the send (so the data could move at once)."""
    sent = peer["send_posted"]
    rows = []
    for label, posted, needed, done, tag in mine["receives"]:
        send = sent.get(tag, needed)
        wait = done - needed
        late = max(min(send, done) - needed, 0.0)
        moved = max(wait - late, 0.0)
        rows.append(
            (label, 1e3 * max(needed - posted, 0.0), 1e3 * wait, 1e3 * late, 1e3 * moved, posted <= send)
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", default="zbv")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (proves the script runs)")
    parser.add_argument("--steps", type=int, default=4, help="steps; the first is a warm-up (headers)")
    parser.add_argument("--prefetch-depth", type=int, default=2)
    parser.add_argument("--verbose", action="store_true", help="every receive of the last step")
    parser.add_argument(
        "--3d", dest="three_d", action="store_true", help="3-D activations (batch, seq, hidden)"
    )
    parser.add_argument(
        "--reset-shapes-each-step",
        action="store_true",
        help="exchange shape headers on every step (the protocol before shapes were agreed once), to compare",
    )
    args = parser.parse_args()
    cfg = BenchConfig(**(dict(hidden=64, ffn=256, tokens=128, seq=32) if args.quick else {}))
    ranks = spawn(
        run_rank,
        2,
        asdict(cfg),
        args.schedule,
        args.steps,
        args.prefetch_depth,
        args.reset_shapes_each_step,
        args.three_d,
        timeout=1800,
        pg_timeout=600,
    )
    headers = "headers every step" if args.reset_shapes_each_step else "shapes agreed on step 0"
    print(
        f"{args.schedule} on 2 gloo ranks, {'3-D' if args.three_d else '2-D'} activations, "
        f"prefetch_depth={args.prefetch_depth}, {headers}: {asdict(cfg)}\n"
    )
    print(
        "| step | measured bubble | simulated (measured costs) | replay (own durations) "
        "| rank: compute / recv wait / other (ms) "
        "| rank: measured - replay = dispatch + transport + propagated (ms) |"
    )
    print("|---:|---:|---:|---:|---|---|")
    for i, step in enumerate(ranks[0]["steps"]):
        idle = "; ".join(
            f"r{r}: {1e3 * v['compute']:.0f} / {1e3 * v['recv_wait']:.1f} / {1e3 * v['other']:.1f}"
            for r, v in step["idle"].items()
        )
        split = "; ".join(
            f"r{r}: {1e3 * v.overhead:.1f} = {1e3 * v.dispatch:.1f} + {1e3 * v.transport:.1f} "
            f"+ {1e3 * v.propagated:+.1f}"
            for r, v in enumerate(step["split"])
        )
        print(
            f"| {i} | {step['bubble']:.4f} | {step['simulated']:.4f} | {step['replay']:.4f} | {idle} | {split} |"
        )
    print()
    for i in range(args.steps):
        for r in (0, 1):
            mine, peer = ranks[r]["steps"][i], ranks[1 - r]["steps"][i]
            rows = split_waits(mine, peer)
            span = mine["idle"] if mine["idle"] else ranks[0]["steps"][i]["idle"]
            span_ms = 1e3 * span[r]["span"]
            other = 1e3 * span[r]["other"]
            total = [sum(row[k] for row in rows) for k in (2, 3, 4)]
            queued, queued_inside = mine["run_queue"]
            print(
                f"step {i} rank {r}: CPU {1e3 * mine['cpu']:.0f} ms in a {span_ms:.0f} ms span; waits {total[0]:.1f} ms "
                f"= producer late {total[1]:.1f} + moving {total[2]:.1f}; other {other:.1f} ms over "
                f"{mine['actions']} actions ({1e3 * other / mine['actions']:.0f} us each; runtime CPU "
                f"{1e6 * mine['runtime_cpu'] / mine['actions']:.0f} us each, {1e3 * mine['runtime_cpu']:.1f} ms); "
                f"run-queue wait {1e3 * queued:.1f} ms, {1e3 * (queued - queued_inside):.1f} of it between "
                f"actions; median lead "
                f"{statistics.median(row[1] for row in rows) if rows else 0:.1f} ms; posted before the peer's "
                f"send {sum(row[5] for row in rows)}/{len(rows)}; {mine['counts']}"
            )
            if args.verbose and i == args.steps - 1:
                for label, lead, wait, late, moved, _ in rows:
                    print(
                        f"    {label:16s} lead {lead:7.2f}  wait {wait:7.2f}  late {late:7.2f}  moved {moved:7.2f}"
                    )


if __name__ == "__main__":
    main()
