"""Run named checks inside spawned gloo ranks, one process group for all (not a test module).

Each check is reported as its own pytest test while process start-up (and the framework's import) is paid
once. Ranks agree after every check whether to go on, so one rank's failure cannot leave another waiting in
a collective its peer never reaches; the checks after a failure are reported as not run.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable

import torch
import torch.distributed as dist

__all__ = ["report", "run_named"]


def run_named(table: dict[str, Callable[[], None]], names: list[str]) -> dict[str, str | None]:
    """``{name: None (passed) | traceback}`` for ``table[name]()`` of each name, in order."""
    results: dict[str, str | None] = {}
    failed: str | None = None
    for name in names:
        if failed is not None:
            results[name] = f"not run: {failed} failed first"
            continue
        try:
            table[name]()
            results[name] = None
        except Exception:
            results[name] = traceback.format_exc()
        flag = torch.tensor([results[name] is not None], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item():
            failed = name
    return results


def report(results: list[dict[str, str | None]], name: str) -> str:
    """The failures of check ``name`` over all ranks (empty when it passed everywhere)."""
    return "\n".join(
        f"--- rank {r} ---\n{res[name]}" for r, res in enumerate(results) if res[name] is not None
    )
