"""``python -m splitgrad schedule NAME``: build, validate and simulate a pipeline schedule; draw it.

Examples::

    python -m splitgrad schedule zb-h1 --stages 4 --microbatches 8 --png zb-h1.png
    python -m splitgrad schedule zb-auto --stages 4 --microbatches 8 --f 1 --b 1.2 --w 0.8 --memory-limit 6
    python -m splitgrad schedule interleaved-1f1b --stages 8 --stages-per-rank 2 --microbatches 8 --ascii
    python -m splitgrad schedule --frontier --ranks 8 --microbatches 24 --f 18522 --b 18086 --w 9337 --png f.png
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["add_parser", "parse_costs", "run"]


def parse_costs(text: str) -> float | list[float]:
    """``"1.5"`` -> one cost for every stage; ``"1,2,1,1"`` -> one per stage."""
    try:
        values = [float(tok) for tok in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a number or comma-separated numbers, got {text!r}"
        ) from None
    return values[0] if len(values) == 1 else values


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register the ``schedule`` sub-command on ``subparsers`` and return its parser."""
    from splitgrad.pipeline.schedules import schedule_names

    parser = subparsers.add_parser(
        "schedule",
        help="build, validate and simulate a pipeline schedule",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "name", nargs="?", choices=schedule_names(), help="schedule family (not with --frontier)"
    )
    parser.add_argument(
        "--frontier",
        action="store_true",
        help="every family's peak memory and bubble on --ranks ranks and the Pareto front (costs per rank)",
    )
    parser.add_argument("--ranks", type=int, default=4, help="--frontier: pipeline ranks (default 4)")
    parser.add_argument(
        "--activation-bytes", type=float, help="--frontier: activation bytes of one microbatch on one rank"
    )
    parser.add_argument("--w-memory", type=float, default=1.0, help="--frontier: M_W / M_B (default 1)")
    parser.add_argument(
        "--overlap", type=float, default=0.0, help="--frontier: hidden fraction of overlapped F+B pairs"
    )
    parser.add_argument("--stages", type=int, default=4, help="total model stages (default 4)")
    parser.add_argument("--microbatches", type=int, default=8, help="microbatches per step (default 8)")
    parser.add_argument("--stages-per-rank", type=int, help="interleaved-1f1b: stages per rank (default 2)")
    parser.add_argument("--split-backward", action="store_true", help="gpipe/1f1b/interleaved: B + W, not BW")
    parser.add_argument(
        "--memory-limit", type=int, help="zb-auto / zbv-auto: activations per rank (default: stages)"
    )
    parser.add_argument("--f", type=parse_costs, default=1.0, help="forward cost, one or one per stage")
    parser.add_argument("--b", type=parse_costs, default=1.0, help="input-gradient cost")
    parser.add_argument("--w", type=parse_costs, default=1.0, help="weight-gradient cost")
    parser.add_argument("--comm", type=float, default=0.0, help="transfer latency between ranks")
    parser.add_argument("--ascii", action="store_true", help="print the simulated timeline as a grid")
    parser.add_argument("--text", action="store_true", help="print the schedule's text form")
    parser.add_argument(
        "--png", help="write a Gantt chart PNG here ('.png' appended when missing; needs matplotlib)"
    )
    parser.add_argument("--trace", help="write a Chrome-trace / Perfetto JSON here")
    parser.set_defaults(func=run)
    return parser


def _options(args: argparse.Namespace) -> dict[str, Any]:
    options: dict[str, Any] = {}
    if args.stages_per_rank is not None:
        options["stages_per_rank"] = args.stages_per_rank
    if args.split_backward:
        options["split_backward"] = True
    if args.name in ("zb-auto", "zbv-auto"):
        options.update(f=args.f, b=args.b, w=args.w, comm=args.comm)
    if args.memory_limit is not None:
        options["memory_limit"] = args.memory_limit
    return options


def output_path(flag: str, text: str | None, suffix: str | None = None) -> Path | None:
    """The file ``--png``/``--trace`` will write, checked before any work: its folder must exist and be
    writable, and it must not be a folder. ``suffix`` is appended when missing (matplotlib would add
    ``.png`` itself, and the path reported must be the file written).

    Raises:
        ValueError: naming the flag and the path.
    """
    if text is None:
        return None
    path = Path(text)
    if suffix is not None and path.suffix.lower() != suffix:
        path = path.with_name(path.name + suffix)
    folder = path.parent
    if path.is_dir():
        raise ValueError(f"{flag} {text}: is a folder, not a file")
    if not folder.is_dir():
        raise ValueError(f"{flag} {text}: folder {folder} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise ValueError(f"{flag} {text}: {path} is not writable")
    return path


def run(args: argparse.Namespace) -> int:
    """Run the sub-command; returns the exit code (0 ok, 1 invalid schedule, 2 bad arguments)."""
    from splitgrad.pipeline import ScheduleError, build_schedule, simulate, validate
    from splitgrad.pipeline.timeline import write_chrome_trace

    if args.frontier or args.name is None:
        return _run_frontier(args)
    try:
        png = output_path("--png", args.png, ".png")
        trace = output_path("--trace", args.trace)
        schedule = build_schedule(args.name, args.stages, args.microbatches, **_options(args))
        validate(schedule)
        result = simulate(schedule, args.f, args.b, args.w, args.comm)
    except ScheduleError as exc:
        return _fail(exc, 1)
    except ValueError as exc:
        return _fail(exc, 2)

    spans = [hi - lo for lo, hi in result.rank_spans]
    critical = max(range(len(spans)), key=spans.__getitem__)
    print(
        f"schedule {schedule.name}: {schedule.n_stages} stages on {schedule.n_ranks} ranks, "
        f"{schedule.n_microbatches} microbatches, {schedule.n_actions} actions: valid"
    )
    print(
        f"simulated (f={args.f}, b={args.b}, w={args.w}, comm={args.comm}): makespan {result.makespan:g}, "
        f"bubble {100 * result.bubble_ratio:.2f}% (rank {critical}: span {spans[critical]:g}, "
        f"work {result.rank_work[critical]:g})"
    )
    print("peak activations per rank: " + " ".join(str(p) for p in result.peak_activations))
    if args.text:
        print(schedule.to_text(), end="")
    if args.ascii:
        print(result.to_ascii())
    writes: list[Callable[[], object]] = []
    if trace is not None:
        writes.append(lambda: write_chrome_trace(result.events(), trace))
    if png is not None:
        writes.append(lambda: result.save_png(png))
    return _write_outputs(writes)


def _run_frontier(args: argparse.Namespace) -> int:
    """``--frontier``: print every family's point and the Pareto front; ``--png`` draws them."""
    from splitgrad.pipeline.schedules.frontier import frontier

    try:
        if args.name is not None or not args.frontier:
            raise ValueError(
                "give a schedule name or --frontier (which compares every family), not both"
                if args.name is not None
                else "a schedule name is required (or --frontier)"
            )
        costs = {k: getattr(args, k) for k in ("f", "b", "w")}
        lists = [k for k, v in costs.items() if isinstance(v, list)]
        if lists:
            raise ValueError(f"--frontier takes one cost per rank's layers, got a list for --{lists[0]}")
        png = output_path("--png", args.png, ".png")
        result = frontier(
            args.ranks,
            args.microbatches,
            **costs,
            comm=args.comm,
            activation_bytes=args.activation_bytes,
            w_memory=args.w_memory,
            overlap=args.overlap,
        )
    except ValueError as exc:
        return _fail(exc, 2)
    f, b, w, comm = result.costs
    print(
        f"frontier: {result.n_ranks} ranks, {result.n_microbatches} microbatches, costs per rank's layers "
        f"f={f:g} b={b:g} w={w:g} comm={comm:g}, w_memory={result.w_memory:g}; memory in {result.memory_unit}"
    )
    print(result.to_table())
    print("Pareto front: " + ", ".join(pt.label for pt in result.pareto))
    return _write_outputs([] if png is None else [lambda: result.save_png(png)])


def _write_outputs(writes: list[Callable[[], object]]) -> int:
    """Run each ``write`` in turn (it returns the path it wrote) and print that path.

    Returns:
        0, or 2 after printing the error once a write fails: ``ImportError`` (no matplotlib for ``--png``) or
        ``OSError`` (the paths were checked before the work, but the file system can still refuse: full disk,
        races).
    """
    try:
        for write in writes:
            print(f"wrote {write()}")
    except ImportError as exc:
        return _fail(exc, 2)
    except OSError as exc:
        return _fail(f"could not write {exc.filename or ''}: {exc.strerror or exc}", 2)
    return 0


def _fail(error: object, code: int) -> int:
    """Print ``error: <error>`` to stderr and return the exit code ``code`` (see :func:`run`)."""
    print(f"error: {error}", file=sys.stderr)
    return code
