"""The tables of the pipeline benchmarks: rows summarised over rounds, the main report and the realisation table."""

from __future__ import annotations

import os
import statistics
from dataclasses import asdict

from _pipeline_variants import REF, REF2, BenchConfig
from splitgrad.pipeline.timeline import TimelineEvent, measured_bubble_ratio


def _rank_compute(events: list[TimelineEvent]) -> dict[int, float]:
    """Seconds of compute events per rank."""
    out: dict[int, float] = {}
    for e in events:
        if e.is_compute:
            out[e.rank] = out.get(e.rank, 0.0) + e.end - e.start
    return out


def summarize(cfg: BenchConfig, timing: list[dict], memory: list[dict]) -> dict[str, dict]:
    rows: dict[str, dict] = {}
    for key, per_round in timing[0]["samples"].items():
        step = statistics.median(s[0] for s in per_round)
        runs = [s[1] for s in per_round if s[1]]
        events = [e for run in runs for e in run]
        kinds = {k: [(e.end - e.start) * 1e3 for e in events if e.kind == k] for k in ("F", "B", "W", "BW")}
        backward: dict[int, list[float]] = {}
        for e in events:
            if e.kind in ("B", "BW"):
                backward.setdefault(e.stage, []).append((e.end - e.start) * 1e3)
        simulated = [s[2] for s in per_round if s[2] is not None]
        rows[key] = {
            "step": step,
            "steps": [s[0] for s in per_round],  # by round: variants ran round-robin, so rounds pair up
            "tok_s": cfg.n_microbatches * cfg.tokens / step,
            "bubble": statistics.median(measured_bubble_ratio(run) for run in runs) if runs else None,
            "simulated": statistics.median(simulated) if simulated else None,
            "compute": statistics.median(max(_rank_compute(run).values()) for run in runs) if runs else None,
            "kinds": {k: (statistics.median(v) if v else None) for k, v in kinds.items()},
            "b_per_stage": [statistics.median(backward[st]) for st in sorted(backward)],
            "peaks": [max(r["samples"][key]) / 2**20 for r in memory],
            # Receive buffers posted ahead and not yet used, at most (rank 0; splitgrad's runtime only).
            "recv_held": max((s[3] for s in per_round if s[3] is not None), default=None),
            "held": [r["held"][key] / 2**20 for r in memory],
            # Replay at the measured per-action durations and the overhead split: medians over rounds.
            "realised": _median_fields([s[4] for s in per_round if s[4] is not None]),
        }
    for key, row in rows.items():
        tag = key.split("|")[0]
        if f"{tag}|{REF}" in rows:  # not in a head-to-head run
            row["eff"] = rows[f"{tag}|{REF}"]["step"] / (2 * row["step"])
            row["eff2"] = rows[f"{tag}|{REF2}"]["step"] / (2 * row["step"])
    return rows


def _median_fields(dicts: list[dict[str, float]]) -> dict[str, float] | None:
    """Field-wise median of equally keyed dicts (None when there are none)."""
    if not dicts:
        return None
    return {
        k: (statistics.median_low if k == "rank" else statistics.median)(d[k] for d in dicts)
        for k in dicts[0]
    }


def cells(values, fmt: str) -> str:
    return " / ".join("-" if v is None else format(v, fmt) for v in values)


def print_report(
    cfg: BenchConfig, rows: dict[str, dict], native: dict[str, str], b_to_w: dict, load: list
) -> None:
    print(f"\nPipeline step, 2 gloo ranks x 1 thread: {asdict(cfg)}")
    print(
        f"machine: {os.cpu_count()} cores; load average (1/5/15 min) before / after: {load[0]} / {load[1]}\n"
    )
    print(
        "| act. | variant | median step (s) | tokens/s | efficiency | eff. vs both-busy ref. | bubble "
        "| step peak MiB r0 / r1 | (held) |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for key, r in rows.items():
        tag, name = key.split("|")
        effs = ("-", "-") if name.startswith("reference") else (f"{r['eff']:.3f}", f"{r['eff2']:.3f}")
        print(
            f"| {tag} | {name} | {r['step']:.3f} | {r['tok_s']:,.0f} | {effs[0]} | {effs[1]} "
            f"| {cells([r['bubble']], '.3f')} | {cells(r['peaks'], '.0f')} | {cells(r['held'], '.0f')} |"
        )
    for name, outcome in native.items():
        print(f"| 3-D | torch {name} | {outcome} | | | | | | |")
    print(
        "\nProfile: per-action medians (ms); B or BW per stage (ms); compute of the busiest rank per step vs"
    )
    print(
        "half the single-process reference; splitgrad's schedules simulated at the measured per-stage costs\n"
    )
    print(
        "| act. | variant | F | B | W | BW | B or BW per stage | busiest-rank compute (s) | / (ref. / 2) "
        "| simulated bubble |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for key, r in rows.items():
        if r["compute"] is None:
            continue
        half = rows[key.split("|")[0] + f"|{REF}"]["step"] / 2
        kinds = " | ".join(cells([v], ".1f") for v in r["kinds"].values())
        print(
            f"| {' | '.join(key.split('|'))} | {kinds} | {cells(r['b_per_stage'], '.0f')} | {r['compute']:.3f} "
            f"| {r['compute'] / half:.2f} | {cells([r['simulated']], '.3f')} |"
        )
    print(
        f"\nOne microbatch through one {cfg.n_blocks // 2}-block stage, one process (MiB above the start)\n"
    )
    print("| | after F | after B / I (alive until W) |\n|---|---:|---:|")
    for name in ("torch I", "splitgrad B"):
        print(f"| {name} | {b_to_w[name + ' after F']:.1f} | {b_to_w[name + ' after B']:.1f} |")
    print("\nTargets")
    print(
        f"- alive from B to W, splitgrad / PyTorch: {b_to_w['splitgrad B after B'] / b_to_w['torch I after B']:.2f}"
    )
    for tag in ("2-D", "3-D"):
        row = {k.split("|")[1]: v for k, v in rows.items() if k.startswith(tag)}
        for name in ("splitgrad zb-h1", "splitgrad zbv"):
            print(
                f"- {tag} {name}: efficiency {row[name]['eff']:.3f} (>= 0.95?), vs both-busy reference "
                f"{row[name]['eff2']:.3f}"
            )
        bubble = row["splitgrad zb-h1"]["bubble"] / row["splitgrad 1f1b"]["bubble"]
        print(f"- {tag} measured bubble splitgrad zb-h1 / 1f1b: {bubble:.3f} (<= 0.4?)")
        pairs = [("splitgrad 1f1b", "torch 1F1B"), ("splitgrad zbv", "torch ZBV")]
        pairs += [(f"torch {t} + adapter", f"torch {t}") for t in ("InterleavedZB", "ZBV")]
        for ours, theirs in pairs:
            if theirs in row:
                ratio = cells([a / b for a, b in zip(row[ours]["peaks"], row[theirs]["peaks"])], ".2f")
                print(f"- {tag} step peak memory {ours} / {theirs}, r0 / r1: {ratio}")


def print_realisation(rows: dict[str, dict]) -> None:
    """Issue 13 item 5, read off one run: per splitgrad schedule, measured bubble within 0.01 of the simulated
    one (at the measured per-stage costs), and throughput at least PyTorch's best zero-bubble schedule on the
    same work (2-D: native or through the adapter; 3-D: through the adapter, PyTorch's own split fails): the
    best by median step time, and the ratio the median over rounds of that round's step-time ratio.

    Next to it, the step replayed at its own per-action durations (:func:`splitgrad.pipeline.timeline.replay_measured`):
    measured - replay is the runtime's overhead without compute jitter, split on the longest-span rank into
    dispatch (idle with every input produced: Python between actions), transport (in a receive wait after the
    producer had finished) and propagated (waiting beyond the replay's for a producer delayed on its own rank);
    dispatch + transport + propagated = measured span - replay span. Medians over rounds, ms per step."""
    print(
        "\nRealising the simulator (targets: measured - simulated <= 0.010; throughput / best torch ZB >= 1.00)\n"
    )
    print(
        "| act. | variant | measured bubble | simulated (measured costs) | measured - simulated "
        "| throughput / best torch ZB | best torch ZB | receive buffers held, rank 0 (MiB) | replay bubble "
        "| measured - replay | overhead on rank: dispatch / transport / propagated (ms per step) "
        "| runtime CPU per action, rank 0 (us) |"
    )
    print("|---|---|---:|---:|---:|---:|---|---:|---:|---:|---|---:|")
    for tag in ("2-D", "3-D"):
        row = {k.split("|")[1]: v for k, v in rows.items() if k.startswith(tag)}
        zb = {n: r["tok_s"] for n, r in row.items() if n.startswith("torch") and "ZB" in n}
        best = max(zb, key=zb.get) if zb else None
        for name in (n for n in row if n.startswith("splitgrad")):
            r = row[name]
            gap = None if None in (r["bubble"], r["simulated"]) else r["bubble"] - r["simulated"]
            # Paired by round (each round ran every variant once, back to back): drift between rounds cancels.
            ratio = statistics.median(t / o for t, o in zip(row[best]["steps"], r["steps"])) if best else None
            held = None if r["recv_held"] is None else r["recv_held"] / 2**20
            real = r["realised"] or {}
            replay = real.get("replay")
            beyond = None if None in (r["bubble"], replay) else r["bubble"] - replay
            split = (
                f"r{real['rank']}: {real['dispatch']:.1f} / {real['transport']:.1f} / {real['propagated']:+.1f}"
                if real
                else "-"
            )
            print(
                f"| {tag} | {name} | {cells([r['bubble']], '.3f')} | {cells([r['simulated']], '.3f')} "
                f"| {cells([gap], '+.3f')} | {cells([ratio], '.3f')} | {best or '-'} | {cells([held], '.1f')} "
                f"| {cells([replay], '.3f')} | {cells([beyond], '+.3f')} | {split} "
                f"| {cells([real.get('cpu_us')], '.0f')} |"
            )
