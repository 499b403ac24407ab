"""Shared helpers for the schedule tests: a random valid-schedule generator and a naive reference simulator.

Both are written independently of the library's engine (dict-keyed fixed-point iteration instead of wake-up
lists) so that comparing the two checks the engine rather than restating it.
"""

from __future__ import annotations

import random
from pathlib import Path

from splitgrad.pipeline import Action, ActionKind, Schedule, simulate

GOLDEN_DIR = Path(__file__).parent / "golden"

F, B, W, BW = ActionKind.F, ActionKind.B, ActionKind.W, ActionKind.BW


def random_valid_schedule(
    rng: random.Random, n_stages: int, n_ranks: int, n_microbatches: int, *, split_prob: float = 0.5
) -> Schedule:
    """A random complete, deadlock-free schedule.

    Stages go to ranks at random (each rank gets at least one). Actions are emitted one at a time in a random
    topological order of the dependency graph and appended to their rank's list, so every rank's list is
    consistent with one global execution order and cannot deadlock.
    """
    stages = list(range(n_stages))
    rng.shuffle(stages)
    stage_to_rank = [0] * n_stages
    for j, s in enumerate(stages):
        stage_to_rank[s] = j if j < n_ranks else rng.randrange(n_ranks)
    split = {(s, i): rng.random() < split_prob for s in range(n_stages) for i in range(n_microbatches)}
    done: set[tuple[int, str, int]] = set()  # (stage, "F"|"G"|"W", mb): G = input gradient exists
    todo = [(s, i) for s in range(n_stages) for i in range(n_microbatches)]
    remaining = {key: ["F", "G", "W"] if split[key] else ["F", "G"] for key in todo}
    lists: list[list[Action]] = [[] for _ in range(n_ranks)]
    while remaining:
        ready = []
        for (s, i), steps in remaining.items():
            needs = {"F": (s - 1, "F", i), "G": (s + 1, "G", i), "W": None}[steps[0]]
            if needs is None or not 0 <= needs[0] < n_stages or needs in done:
                ready.append((s, i))
        s, i = rng.choice(ready)
        step = remaining[(s, i)].pop(0)
        if not remaining[(s, i)]:
            del remaining[(s, i)]
        done.add((s, step, i))
        kind = {"F": F, "W": W, "G": B if split[(s, i)] else BW}[step]
        lists[stage_to_rank[s]].append(Action(s, kind, i))
    return Schedule(
        name="random", n_microbatches=n_microbatches, stage_to_rank=tuple(stage_to_rank), rank_actions=lists
    )


def reference_times(
    schedule: Schedule, f: list[float], b: list[float], w: list[float], comm: float
) -> list[list[tuple[float, float]]]:
    """(start, end) of every action by naive repeated scans (O(n^2)), or raise if the ranks get stuck."""
    n = schedule.n_stages
    end: dict[tuple[int, str, int], float] = {}
    pos = [0] * schedule.n_ranks
    free = [0.0] * schedule.n_ranks
    out: list[list[tuple[float, float]]] = [[] for _ in range(schedule.n_ranks)]
    progress = True
    while progress:
        progress = False
        for r, acts in enumerate(schedule.rank_actions):
            while pos[r] < len(acts):
                s, kind, i = acts[pos[r]]
                if kind is F:
                    deps = [((s - 1, "F", i), schedule.stage_to_rank[s - 1] != r)] if s > 0 else []
                    cost, produces = f[s], (s, "F", i)
                elif kind is W:
                    deps = [((s, "B", i), False)]
                    cost, produces = w[s], None
                else:
                    deps = [((s, "F", i), False)]
                    if s < n - 1:
                        deps.append(((s + 1, "G", i), schedule.stage_to_rank[s + 1] != r))
                    cost = b[s] + (w[s] if kind is BW else 0.0)
                    produces = (s, "G", i)
                if any(key not in end for key, _ in deps):
                    break
                start = max([free[r]] + [end[key] + (comm if cross else 0.0) for key, cross in deps])
                finish = start + cost
                if produces is not None:
                    end[produces] = finish
                if kind is B:
                    end[(s, "B", i)] = finish
                out[r].append((start, finish))
                free[r] = finish
                pos[r] += 1
                progress = True
    if any(p < len(acts) for p, acts in zip(pos, schedule.rank_actions)):
        raise RuntimeError("reference simulation stuck")
    return out


def golden_text(schedule: Schedule) -> str:
    """Golden-file body: a commented unit-cost picture (for human review) followed by the text form."""
    result = simulate(schedule)
    picture = result.to_ascii().splitlines()
    header = [
        f"# {schedule.name}: {schedule.n_stages} stages, {schedule.n_ranks} ranks, "
        f"{schedule.n_microbatches} microbatches",
        f"# unit costs: bubble_ratio={result.bubble_ratio:.6f} makespan={result.makespan:g} "
        f"peak_activations={' '.join(map(str, result.peak_activations))}",
        *(f"# {line}" for line in picture),
    ]
    return "\n".join(header) + "\n" + schedule.to_text()
