"""One entry point for every FSDP2 check, run in a single spawn of 4 gloo ranks (imported by the children).

Process start-up and ``import torch`` dominate these small checks on a loaded machine, so the 2-D pipeline
checks (pp=2 x fsdp=2), the plain FSDP2 checks (fsdp=4 over the default group) and the HSDP checks
(replicate=2 x shard=2) share one spawn; each check
is still reported as its own test.
"""

from __future__ import annotations

import traceback

import torch.distributed as dist

from tests.fsdp import fsdp_checks, hsdp_checks, pipeline_checks

WORLD = 4
CHECKS = [*fsdp_checks.CHECKS, *hsdp_checks.CHECKS, *pipeline_checks.CHECKS]
NAMES = [f.__name__ for f in CHECKS]


def run_checks(rank: int, world: int, names: list[str]) -> dict[str, str | None]:
    """Run the named checks in order; each reports None or its traceback, then the ranks meet again."""
    table = {f.__name__: f for f in CHECKS}
    results: dict[str, str | None] = {}
    for name in names:
        try:
            table[name](rank, world)
            results[name] = None
        except Exception:
            results[name] = traceback.format_exc()
        dist.barrier()
    return results


def failures(results: list[dict[str, str | None]], name: str) -> str:
    """Every rank's traceback for check ``name``, or an empty string."""
    return "\n".join(
        f"--- rank {r} ---\n{res[name]}" for r, res in enumerate(results) if res[name] is not None
    )
