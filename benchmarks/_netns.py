"""Run a command in a private network namespace whose loopback is rate-limited (communication that takes
wall time but little CPU), so that overlap of computation and communication can be measured on a small box.

On 2 cores, gloo over plain loopback is CPU work (memcpy through the kernel): hiding it behind computation
is impossible, and every "overlap" figure measured that way is meaningless. Inside a namespace whose ``lo``
goes through a token-bucket filter (``tc qdisc ... tbf``), a 16 MiB all-reduce between 2 ranks takes about
270 ms of wall time at 1 Gbit/s and a few ms of CPU: the link, not the cores, is the bottleneck, as on a
real network. ``netem`` is not needed (and is absent from many kernels); ``tbf`` is enough.

Only loopback addresses exist inside the namespace; it is always deleted afterwards, also on Ctrl-C or SIGTERM.

Use it as a command wrapper::

    python benchmarks/_netns.py --rate 1gbit -- python benchmarks/bench_ddp.py --ranks 2
    python benchmarks/_netns.py --rate 4gbit --selftest      # all-reduce time and CPU inside the namespace

or from Python (``with rate_limited_namespace("1gbit") as prefix: subprocess.run([*prefix, ...])``).
Needs root and the ``ip`` and ``tc`` tools (iproute2); anything else fails with a message saying which.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence

__all__ = ["NetnsUnavailable", "rate_limited_namespace", "run_in_namespace"]

# tbf needs a burst of at least rate / HZ bytes; 256 KiB covers up to ~8 Gbit/s at HZ=250 without shaping
# the benchmark's own small messages into queueing noise. The latency bound only limits the queue length.
_BURST = "256kb"
_LATENCY = "2000ms"


class NetnsUnavailable(RuntimeError):
    """The namespace cannot be made here (not root, ``ip``/``tc`` missing, or the kernel refused)."""


def _require_tools() -> None:
    if os.geteuid() != 0:
        raise NetnsUnavailable("a rate-limited network namespace needs root (ip netns add); run as root")
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise NetnsUnavailable(
            f"missing {' and '.join(missing)} (install iproute2) for the rate-limited namespace"
        )


def _run(args: Sequence[str]) -> None:
    done = subprocess.run(list(args), capture_output=True, text=True)
    if done.returncode != 0:
        raise NetnsUnavailable(f"`{' '.join(args)}` failed ({done.returncode}): {done.stderr.strip()}")


@contextlib.contextmanager
def rate_limited_namespace(rate: str = "1gbit", *, name: str | None = None) -> Iterator[list[str]]:
    """Create a namespace whose loopback is limited to ``rate``; yield the command prefix that runs inside it.

    Args:
        rate: a ``tc`` rate (``"1gbit"``, ``"500mbit"``, ...). Every byte between two ranks crosses ``lo``
            once, so this is the point-to-point bandwidth each direction shares.
        name: namespace name (default ``splitgrad-bench-<pid>``).

    Yields:
        ``["ip", "netns", "exec", name]``: prepend it to a command.

    Raises:
        NetnsUnavailable: not root, tools missing, or a step failed (the namespace is removed again).
    """
    _require_tools()
    name = name or f"splitgrad-bench-{os.getpid()}"
    _run(["ip", "netns", "add", name])
    try:
        _run(["ip", "netns", "exec", name, "ip", "link", "set", "lo", "up"])
        _run(
            ["ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", "lo", "root", "tbf",
             "rate", rate, "burst", _BURST, "latency", _LATENCY]
        )  # fmt: skip
        yield ["ip", "netns", "exec", name]
    finally:
        subprocess.run(["ip", "netns", "delete", name], capture_output=True)


def run_in_namespace(command: Sequence[str], *, rate: str = "1gbit") -> int:
    """Run ``command`` inside a fresh rate-limited namespace; returns its exit code.

    A SIGTERM (``kill``, ``timeout``) is passed on to the command, and the namespace is deleted once it has
    exited, as on Ctrl-C: Python's default SIGTERM action would end this process without its cleanup. The
    handler is in place before the namespace exists: a SIGTERM while it is being set up skips the command.
    """
    child: subprocess.Popen | None = None
    stopped = False

    def on_sigterm(signum: int, frame: object) -> None:
        nonlocal stopped
        stopped = True
        if child is not None:
            child.terminate()

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        with rate_limited_namespace(rate) as prefix:
            if stopped:
                return 128 + signal.SIGTERM  # what the shell reports for a command ended by SIGTERM
            child = subprocess.Popen([*prefix, *command])
            if stopped:  # the signal came while the command was starting, before `child` was set
                child.terminate()
            try:
                return child.wait()
            finally:
                # Ctrl-C or an error here: do not leave it running in a deleted namespace.
                if child.poll() is None:
                    child.kill()
                    child.wait()
    finally:
        signal.signal(signal.SIGTERM, previous)


def _selftest(mib: int) -> None:
    """Time a ``mib`` MiB float32 all-reduce between 2 gloo ranks (wall and CPU); run it inside the namespace."""
    import tempfile
    import time

    import torch
    import torch.distributed as dist
    import torch.multiprocessing as mp

    def rank_main(rank: int, path: str, out: dict) -> None:
        torch.set_num_threads(1)
        store = dist.FileStore(path, 2)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
        t = torch.ones(mib * 2**18)
        dist.all_reduce(t)  # warm-up: connection set-up
        wall, cpu = time.perf_counter(), time.process_time()
        dist.all_reduce(t)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        dist.destroy_process_group()
        if rank == 0:
            print(f"all-reduce {mib} MiB between 2 ranks: {wall * 1e3:.1f} ms wall, {cpu * 1e3:.1f} ms CPU")

    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(rank_main, args=(os.path.join(tmp, "store"), {}), nprocs=2, start_method="fork")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--rate", default="1gbit", help="loopback rate inside the namespace (default %(default)s)"
    )
    parser.add_argument(
        "--selftest", action="store_true", help="time a 16 MiB all-reduce inside the namespace"
    )
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- command to run inside the namespace")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if args.selftest:
        command = [sys.executable, os.path.abspath(__file__), "--inside-selftest"]
    if not command:
        parser.error("give a command after -- (or --selftest)")
    try:
        return run_in_namespace(command, rate=args.rate)
    except NetnsUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    if sys.argv[1:] == ["--inside-selftest"]:
        _selftest(16)
        sys.exit(0)
    sys.exit(main())
