"""Check that a schedule is complete, in dependency order, and cannot deadlock.

:func:`validate` raises :class:`~splitgrad.pipeline.ScheduleError` with every problem found and a listing of the
ranks' actions around the offending ones (``[1B0]`` marks where a rank is stuck). :func:`find_problems` returns
the same messages as a list instead of raising.

Checks, in order (later ones only run when earlier ones pass):

1. shape: each action's stage exists and runs on that rank; microbatch indices are in range;
2. completeness: for every ``(stage, microbatch)``, ``F`` exactly once and either ``B`` and ``W`` exactly once
   or ``BW`` exactly once (parts of overlapped ``F+B`` actions count); per stage at most one gradient-sync
   point of each kind, ``R`` after the stage's last ``F`` and ``RF`` after all its compute and its ``R``;
3. order and deadlock: the schedule runs to the end under the blocking model of
   :mod:`splitgrad.pipeline.ir.simulate` (receives block, sends are asynchronous). This covers ``F`` before
   ``B`` before ``W``, stage order across ranks, and cycles of ranks waiting on each other;
4. optionally (``ordered_channels=True``), for runtimes whose transport matches messages between two ranks
   in posting order (NCCL ignores tags): each rank sends to a peer in the same order the peer receives.
"""

from __future__ import annotations

from operator import itemgetter

from ._engine import run_engine
from ._perf import gc_paused
from .actions import COMPUTE_KINDS, Action, ActionKind, OverlapAction, Schedule, ScheduleError

# check_structure is the simulator's fast shape check (ir-internal), not part of the public surface.
__all__ = ["channel_order_problems", "find_problems", "render_listing", "validate"]

_MAX_LISTED = 20
_stage_of, _kind_of, _microbatch_of = itemgetter(0), itemgetter(1), itemgetter(2)


def _structure_ok(schedule: Schedule) -> bool:
    """Fast path of :func:`_structure_problems`: C-level set/map passes instead of a message per action."""
    m = schedule.n_microbatches
    kinds = COMPUTE_KINDS
    for r, acts in enumerate(schedule.rank_actions):
        if not acts:
            continue
        if set(map(type, acts)) != {Action}:
            return False
        if (
            not set(map(_stage_of, acts)) <= set(schedule.stages_of(r))
            or not set(map(_kind_of, acts)) <= kinds
        ):
            return False
        mbs = list(map(_microbatch_of, acts))
        if min(mbs) < 0 or max(mbs) >= m:
            return False
    return True


def _structure_problems(schedule: Schedule) -> list[str]:
    if _structure_ok(schedule):
        return []
    n, m = schedule.n_stages, schedule.n_microbatches
    s2r = schedule.stage_to_rank
    problems = []
    for r, acts in enumerate(schedule.rank_actions):
        for pos, whole in enumerate(acts):
            if isinstance(whole, OverlapAction):
                parts = whole.parts
                if not all(isinstance(a, Action) for a in parts) or (
                    parts[0].kind is not ActionKind.F or parts[1].kind not in (ActionKind.B, ActionKind.BW)
                ):
                    problems.append(
                        f"rank {r} position {pos}: {whole!r} must overlap an F action with a B or BW action"
                    )
                    continue
            else:
                parts = (whole,)
            for action in parts:
                if not isinstance(action, Action) or not isinstance(action.kind, ActionKind):
                    problems.append(f"rank {r} position {pos}: {action!r} is not an Action")
                    continue
                stage, kind, mb = action
                if kind is ActionKind.FB:
                    problems.append(f"rank {r} position {pos}: {action!r}: kind FB needs an OverlapAction")
                    continue
                if not isinstance(stage, int) or not 0 <= stage < n:
                    problems.append(
                        f"rank {r} position {pos}: {action} names stage {stage} outside 0..{n - 1}"
                    )
                elif s2r[stage] != r:
                    problems.append(
                        f"rank {r} position {pos}: {action} belongs to rank {s2r[stage]} (stage {stage})"
                    )
                if kind in COMPUTE_KINDS:
                    if not isinstance(mb, int) or not 0 <= mb < m:
                        problems.append(
                            f"rank {r} position {pos}: {action} names microbatch {mb} outside 0..{m - 1}"
                        )
                elif mb is not None:
                    problems.append(
                        f"rank {r} position {pos}: gradient-sync point {action!r} takes no microbatch (got {mb})"
                    )
    return problems


def check_structure(schedule: Schedule) -> None:
    """Raise :class:`ScheduleError` unless every action names an existing stage on its own rank and a
    microbatch in range (the cheap part of :func:`validate`, needed before simulating)."""
    problems = _structure_problems(schedule)
    if problems:
        raise ScheduleError(_format(schedule, "malformed", problems, {}))


def _completeness_problems(schedule: Schedule) -> list[str]:
    n, m = schedule.n_stages, schedule.n_microbatches
    size = n * m
    F, B, W, BW = ActionKind.F, ActionKind.B, ActionKind.W, ActionKind.BW
    counts = {kind: [0] * size for kind in (F, B, W, BW)}
    cf, cb, cw, cbw = counts[F], counts[B], counts[W], counts[BW]
    for acts in schedule.rank_actions:
        for whole in acts:
            for s, k, i in whole.parts:
                if i is not None:
                    counts[k][s * m + i] += 1
    backward_ok = {(1, 1, 0), (0, 0, 1)}  # (B, W, BW) counts: split once, or full once
    if cf.count(1) == size and all(t in backward_ok for t in zip(cb, cw, cbw)):
        return []
    problems: list[str] = []
    for kind, cnt in counts.items():
        problems += [
            f"{Action(idx // m, kind, idx % m)} appears {c} times" for idx, c in enumerate(cnt) if c > 1
        ]
    for idx in range(size):
        s, i = divmod(idx, m)
        if not cf[idx]:
            problems.append(f"missing {Action(s, F, i)}")
        has_b, has_w, has_bw = cb[idx] > 0, cw[idx] > 0, cbw[idx] > 0
        if has_bw and (has_b or has_w):
            problems.append(
                f"{Action(s, BW, i)} and a split {Action(s, B, i)}/{Action(s, W, i)} both present"
            )
        elif not has_bw and not (has_b and has_w):
            if has_b or has_w:
                problems.append(f"missing {Action(s, W if has_b else B, i)}")
            else:
                problems.append(f"missing backward of stage {s} microbatch {i} ({Action(s, BW, i)} or B+W)")
    return problems


def _sync_problems(schedule: Schedule) -> list[str]:
    """Each stage has at most one ``R`` (after its last ``F``) and one ``RF`` (after its compute and ``R``)."""
    problems = []
    for r, acts in enumerate(schedule.rank_actions):
        marks: dict[tuple[int, ActionKind], list[int]] = {}
        last_f: dict[int, int] = {}
        last_compute: dict[int, int] = {}
        for pos, whole in enumerate(acts):
            for s, k, _ in whole.parts:
                if k is ActionKind.R or k is ActionKind.RF:
                    marks.setdefault((s, k), []).append(pos)
                    continue
                last_compute[s] = pos
                if k is ActionKind.F:
                    last_f[s] = pos
        for (s, k), where in sorted(marks.items()):
            name = Action(s, k, None).name
            if len(where) > 1:
                problems.append(f"rank {r}: {name} appears {len(where)} times (positions {where})")
            if k is ActionKind.R and last_f.get(s, -1) > where[0]:
                problems.append(
                    f"rank {r}: {name} (position {where[0]}) comes before stage {s}'s last forward (position "
                    f"{last_f[s]}); reductions may only start once every forward has counted its gradients"
                )
            if k is ActionKind.RF:
                if last_compute.get(s, -1) > where[-1]:
                    problems.append(
                        f"rank {r}: {name} (position {where[-1]}) comes before stage {s}'s last compute action "
                        f"(position {last_compute[s]}); a gradient would arrive after its reduction finished"
                    )
                opened = marks.get((s, ActionKind.R))
                if opened and opened[-1] > where[-1]:
                    problems.append(
                        f"rank {r}: {name} (position {where[-1]}) comes before {s}R ({opened[-1]})"
                    )
    return problems


def _deadlock_problems(schedule: Schedule) -> tuple[list[str], dict[int, int]]:
    n = schedule.n_stages
    zeros = (0.0,) * n
    run = run_engine(schedule, zeros, zeros, zeros, 0.0)
    if run.completed:
        return [], {}
    positions = {
        a: (r, p)
        for r, acts in enumerate(schedule.rank_actions)
        for p, whole in enumerate(acts)
        for a in whole.parts
    }
    blocked_at = {r: len(run.starts[r]) for r, _, _ in run.blocked}
    problems = []
    for r, action, missing in run.blocked:
        head = f"rank {r} is stuck at {action} (position {blocked_at[r]})"
        if missing is None:
            problems.append(f"{head}: it repeats work already done or follows a full BW")
            continue
        if (
            missing.kind is ActionKind.B
            and Action(missing.stage, ActionKind.BW, missing.microbatch) in positions
        ):
            missing = Action(missing.stage, ActionKind.BW, missing.microbatch)
        where = positions.get(missing)
        if where is None:
            problems.append(f"{head}: it needs {missing}, which no rank runs")
        elif where[0] == r:
            problems.append(
                f"{head}: it needs {missing}, which comes later on the same rank (position {where[1]})"
            )
        else:
            other = where[0]
            state = (
                f"rank {other} is stuck at {schedule.rank_actions[other][blocked_at[other]]}"
                if other in blocked_at
                else f"rank {other} never reaches it"
            )
            problems.append(
                f"{head}: it waits for {missing} from rank {other} (position {where[1]}), but {state}"
            )
    return ["deadlock under blocking point-to-point: " + problems[0], *problems[1:]], blocked_at


def channel_order_problems(schedule: Schedule) -> list[str]:
    """Messages between two ranks that are sent in a different order than the receiver consumes them.

    Only matters for transports that pair sends and receives between two ranks by posting order.
    """
    sent: dict[tuple[int, int], list[tuple[str, int, int]]] = {}
    received: dict[tuple[int, int], list[tuple[str, int, int]]] = {}
    for acts in schedule.rank_actions:
        for action in acts:
            for out in schedule.sends(action):
                sent.setdefault((out.src_rank, out.dst_rank), []).append(
                    (out.kind, out.src_stage, out.microbatch)
                )
            for inc in schedule.receives(action):
                received.setdefault((inc.src_rank, inc.dst_rank), []).append(
                    (inc.kind, inc.src_stage, inc.microbatch)
                )
    problems = []
    for channel in sorted(sent.keys() | received.keys()):
        a, b = sent.get(channel, []), received.get(channel, [])
        for j, (x, y) in enumerate(zip(a, b)):
            if x != y:
                problems.append(
                    f"rank {channel[0]} -> rank {channel[1]}: message {j} is sent as {x[0]} of stage {x[1]} "
                    f"microbatch {x[2]} but received as {y[0]} of stage {y[1]} microbatch {y[2]}"
                )
                break
    return problems


@gc_paused()
def find_problems(schedule: Schedule, *, ordered_channels: bool = False) -> list[str]:
    """Every problem :func:`validate` would report, as messages (empty when the schedule is valid)."""
    problems = _structure_problems(schedule)
    if problems:
        return problems
    problems = _completeness_problems(schedule) + _sync_problems(schedule)
    if problems:
        return problems
    problems, _ = _deadlock_problems(schedule)
    if problems:
        return problems
    return channel_order_problems(schedule) if ordered_channels else []


@gc_paused()
def validate(schedule: Schedule, *, ordered_channels: bool = False) -> None:
    """Raise :class:`ScheduleError` unless ``schedule`` is complete, ordered and deadlock-free.

    Args:
        schedule: the schedule to check.
        ordered_channels: also require every rank pair's messages to be received in sending order.

    Raises:
        ScheduleError: with every problem found and a listing of the actions around them.
    """
    problems = _structure_problems(schedule)
    if problems:
        raise ScheduleError(_format(schedule, "malformed", problems, {}))
    problems = _completeness_problems(schedule) + _sync_problems(schedule)
    if problems:
        raise ScheduleError(_format(schedule, "incomplete", problems, {}))
    problems, blocked_at = _deadlock_problems(schedule)
    if problems:
        raise ScheduleError(_format(schedule, "cannot run", problems, blocked_at))
    if ordered_channels:
        problems = channel_order_problems(schedule)
        if problems:
            raise ScheduleError(_format(schedule, "has out-of-order channels", problems, {}))


def render_listing(schedule: Schedule, marks: dict[int, int] | None = None, *, window: int = 8) -> str:
    """Each rank's actions in order, ``[...]`` around ``marks[rank]`` (a position), cut to ``window``
    actions either side of the mark (or to the first ``2 * window`` when a rank is unmarked)."""
    marks = marks or {}
    lines = []
    for r, acts in enumerate(schedule.rank_actions):
        names = [a.name if isinstance(a, Action | OverlapAction) else repr(a) for a in acts]
        mark = marks.get(r)
        if mark is not None and mark < len(names):
            names[mark] = f"[{names[mark]}]"
            lo, hi = max(0, mark - window), min(len(names), mark + window + 1)
        else:
            lo, hi = 0, min(len(names), 2 * window)
        body = ("... " if lo else "") + " ".join(names[lo:hi]) + (" ..." if hi < len(names) else "")
        lines.append(f"  rank {r}: {body}")
    return "\n".join(lines)


def _format(schedule: Schedule, what: str, problems: list[str], marks: dict[int, int]) -> str:
    shown = problems[:_MAX_LISTED]
    more = f"\n  ... and {len(problems) - len(shown)} more" if len(problems) > len(shown) else ""
    return (
        f"schedule {schedule.name!r} ({schedule.n_stages} stages, {schedule.n_ranks} ranks, "
        f"{schedule.n_microbatches} microbatches) {what}:\n"
        + "\n".join(f"  - {p}" for p in shown)
        + more
        + "\nactions per rank ([x] = where the rank is stuck):\n"
        + render_listing(schedule, marks)
    )
