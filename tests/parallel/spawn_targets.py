"""Functions run by the spawn-harness tests inside child processes (importable by name)."""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist


def fail_hang_or_return(rank: int, world_size: int, pid_dir: str) -> int:
    """Rank 1 raises, rank 2 hangs forever, rank 0 returns after a collective-free moment."""
    with open(os.path.join(pid_dir, f"rank{rank}.pid"), "w") as f:
        f.write(str(os.getpid()))
    if rank == 1:
        # Fail only once rank 2 is inside fn (its pid written): under load, a rank still importing torch when
        # the grace period ends is killed before it writes its pid, and the test could not check the kill.
        deadline = time.monotonic() + 60
        while not os.path.exists(os.path.join(pid_dir, "rank2.pid")) and time.monotonic() < deadline:
            time.sleep(0.05)
        raise ValueError(f"boom from rank {rank} of {world_size}")
    if rank == 2:
        while True:
            time.sleep(0.1)
    return rank


def hang(rank: int, world_size: int) -> None:
    while True:
        time.sleep(0.1)


def all_reduce_ranks(rank: int, world_size: int) -> dict[str, object]:
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return {"rank": rank, "sum": t.item(), "tensor": torch.arange(3) * rank}
