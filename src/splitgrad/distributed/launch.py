"""Run a function on several local ranks with a process group, and get their results or their errors.

:func:`spawn` starts ``world_size`` fresh processes (the ``spawn`` start method: nothing inherited but
``sys.path``), initialises a process group in each over a private :class:`torch.distributed.FileStore` (no
port to race for), calls ``fn(rank, world_size, *args)``, destroys the process group, and returns the
per-rank return values. It never hangs: a rank that raises is reported with its rank and remote traceback,
the other ranks are given a moment to report and then killed; ranks still running at ``timeout`` are killed
and named.

A run succeeds only if every rank process also *exits* with code 0: a crash while tearing down (a process
group destroyed during interpreter shutdown aborts with SIGABRT) turns a finished job into a failed one under
torchrun, so the harness fails the run too, naming the rank and its exit code or signal.

Each spawn costs process start-up and a torch import (seconds): batch many checks into one ``fn``.
``fn`` must be importable by name (a module-level function), its arguments and return value picklable.
"""

from __future__ import annotations

import datetime
import os
import pickle
import queue as queue_mod
import shutil
import signal
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .teardown import destroy_process_group

__all__ = ["RankFailure", "SpawnError", "SpawnTimeoutError", "spawn"]


@dataclass(kw_only=True, slots=True)
class RankFailure:
    """What one rank reported instead of a result."""

    rank: int
    """The rank (in the spawned group)."""
    exc_type: str
    """Qualified name of the exception type, or ``"exit"`` for a process that died without reporting."""
    message: str
    """``str(exception)``, or the exit code."""
    traceback: str
    """The formatted remote traceback (empty for a process that died)."""


class SpawnError(RuntimeError):
    """One or more ranks failed; :attr:`failures` lists them, the first to fail first."""

    def __init__(self, failures: list[RankFailure], note: str = "") -> None:
        self.failures = failures
        first = failures[0] if failures else None
        lines = [note] if note else []
        if first is not None:
            lines.append(f"rank {first.rank} failed first with {first.exc_type}: {first.message}")
            lines.extend(f"  then rank {f.rank}: {f.exc_type}: {f.message}" for f in failures[1:])
            if first.traceback:
                lines.append(f"--- remote traceback of rank {first.rank} ---\n{first.traceback}")
        super().__init__("\n".join(lines))


class SpawnTimeoutError(SpawnError, TimeoutError):
    """Some ranks were still running at the deadline and were killed; :attr:`stuck` names them."""

    def __init__(self, stuck: list[int], timeout: float, failures: list[RankFailure]) -> None:
        self.stuck = stuck
        note = f"rank(s) {stuck} did not finish within {timeout:g} s and were killed"
        super().__init__(failures, note)


def spawn(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    backend: str | None = "gloo",
    pg_timeout: float = 60.0,
    threads: int = 1,
    grace: float = 3.0,
    exit_timeout: float = 60.0,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` local processes; return their results.

    Args:
        fn: a module-level function (pickled by name).
        world_size: number of ranks (>= 1).
        *args: extra picklable arguments, identical on every rank.
        timeout: seconds for the whole run, start-up included; ranks still running then are killed.
        backend: process-group backend initialised before ``fn`` runs (``"gloo"``, ``"nccl"``: each rank then
            uses device ``rank`` of the accelerator), or None to let ``fn`` set one up itself.
        pg_timeout: the process group's collective timeout, seconds.
        threads: ``torch.set_num_threads`` in each rank (ranks share the machine's cores).
        grace: after the first failure, seconds the other ranks get to report before being killed.
        exit_timeout: after every rank reported its result, seconds they get to tear down and exit.

    Returns:
        ``[result of rank 0, result of rank 1, ...]``.

    Raises:
        SpawnError: a rank raised or died, or reported its result and then exited with a non-zero code, a
            signal, or not within ``exit_timeout``; the message names it (and carries its remote traceback).
        SpawnTimeoutError: ranks did not finish in ``timeout``; they were killed.
    """
    if world_size < 1:
        raise ValueError(f"spawn needs world_size >= 1, got {world_size=}")
    if timeout <= 0 or pg_timeout <= 0 or exit_timeout <= 0:
        raise ValueError(f"spawn timeouts must be positive, got {timeout=} {pg_timeout=} {exit_timeout=}")
    ctx = mp.get_context("spawn")
    results_q = ctx.Queue()
    workdir = tempfile.mkdtemp(prefix="splitgrad-spawn-")
    store_path = os.path.join(workdir, "store")
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(rank, world_size, fn, args, store_path, backend, pg_timeout, threads, results_q),
            daemon=True,
            name=f"splitgrad-rank{rank}",
        )
        for rank in range(world_size)
    ]
    try:
        for proc in procs:
            proc.start()
        results = _collect(procs, results_q, timeout=timeout, grace=grace)
        _check_exits(procs, exit_timeout)
        return results
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        results_q.close()
        shutil.rmtree(workdir, ignore_errors=True)


def _check_exits(procs: list, exit_timeout: float) -> None:
    """Every rank reported success: wait for each to exit and fail the run unless all exit with code 0."""
    deadline = time.monotonic() + exit_timeout
    failures = []
    for rank, proc in enumerate(procs):
        proc.join(timeout=max(0.0, deadline - time.monotonic()))
        if proc.exitcode == 0:
            continue
        if proc.exitcode is None:
            message = f"did not exit within {exit_timeout:g} s after reporting its result (killed)"
        else:
            message = f"{_describe_exit(proc.exitcode)} after reporting its result"
        failures.append(RankFailure(rank=rank, exc_type="exit", message=message, traceback=""))
    if failures:
        raise SpawnError(
            failures,
            "every rank returned a result, but not every rank process exited cleanly (a crash while tearing "
            "down, e.g. a process group destroyed during interpreter shutdown, fails a torchrun job too)",
        )


def _describe_exit(exitcode: int) -> str:
    """``"exit code 3"`` or ``"killed by signal SIGABRT (6)"`` (multiprocessing reports signals negated)."""
    if exitcode >= 0:
        return f"exit code {exitcode}"
    try:
        name = signal.Signals(-exitcode).name
    except ValueError:
        name = "unknown signal"
    return f"killed by signal {name} ({-exitcode})"


def _collect(procs: list, results_q: Any, *, timeout: float, grace: float) -> list[Any]:
    world_size = len(procs)
    deadline = time.monotonic() + timeout
    results: dict[int, Any] = {}
    failures: list[RankFailure] = []
    reported: set[int] = set()
    failed_at: float | None = None
    while len(reported) < world_size:
        now = time.monotonic()
        if now >= deadline or (failed_at is not None and now >= failed_at + grace):
            break
        try:
            rank, status, payload = results_q.get(timeout=0.1)
        except queue_mod.Empty:
            for rank, proc in enumerate(procs):
                if rank not in reported and proc.exitcode is not None:
                    # Its last message may still be in the pipe: drain once before calling it a crash.
                    try:
                        late = results_q.get(timeout=0.5)
                    except queue_mod.Empty:
                        late = None
                    if late is not None:
                        _record(late, results, failures, reported)
                        continue
                    reported.add(rank)
                    failures.append(
                        RankFailure(
                            rank=rank,
                            exc_type="exit",
                            message=f"died without reporting: {_describe_exit(proc.exitcode)}",
                            traceback="",
                        )
                    )
            if failures and failed_at is None:
                failed_at = time.monotonic()
            continue
        _record((rank, status, payload), results, failures, reported)
        if failures and failed_at is None:
            failed_at = time.monotonic()
    stuck = [r for r in range(world_size) if r not in reported]
    if stuck and not failures:
        raise SpawnTimeoutError(stuck, timeout, failures)
    if failures:
        note = f"(rank(s) {stuck} still running were killed)" if stuck else ""
        raise SpawnError(failures, note)
    return [results[r] for r in range(world_size)]


def _record(message: tuple, results: dict, failures: list[RankFailure], reported: set[int]) -> None:
    rank, status, payload = message
    reported.add(rank)
    if status == "ok":
        results[rank] = pickle.loads(payload)
    else:
        exc_type, text, tb = payload
        failures.append(RankFailure(rank=rank, exc_type=exc_type, message=text, traceback=tb))


def _rank_main(
    rank: int,
    world_size: int,
    fn: Callable[..., Any],
    args: tuple,
    store_path: str,
    backend: str | None,
    pg_timeout: float,
    threads: int,
    results_q: Any,
) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(threads)
    try:
        if backend is not None:
            if backend == "nccl":
                torch.cuda.set_device(rank % torch.cuda.device_count())
            dist.init_process_group(
                backend,
                store=dist.FileStore(store_path, world_size),
                rank=rank,
                world_size=world_size,
                timeout=datetime.timedelta(seconds=pg_timeout),
            )
        result = fn(rank, world_size, *args)
        # Plain pickle, not the queue's: torch's queue reducers would share tensor storage with a process
        # that is about to exit.
        message = (rank, "ok", pickle.dumps(result))
        del result  # objects fn returned must not hold the process group past its destruction
        # Torn down before reporting, so an error here fails the run; a crash later, at interpreter exit, is
        # caught by the parent from the exit code. (Not after a failure: peers may be stuck in a collective.)
        # teardown's destroy collects fn's reference cycles and DTensor's caches first: destroying the last
        # reference joins gloo's workers.
        if dist.is_initialized():
            destroy_process_group()
    except BaseException as exc:  # report everything, KeyboardInterrupt included, then exit
        kind = type(exc)
        message = (
            rank,
            "error",
            (f"{kind.__module__}.{kind.__qualname__}", str(exc), traceback.format_exc()),
        )
    results_q.put(message)
    results_q.close()
    results_q.join_thread()
