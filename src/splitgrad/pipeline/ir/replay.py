"""Round-robin replay of per-rank action orders: the loop a pass or a generator runs to time a fixed order.

Each rank runs its order front to back; a rank whose next item cannot run yet (an input not produced) waits
while the others advance, until no rank can. Passes that re-time a schedule and generators that re-time a
block share it, so they agree on the order in which ranks advance (and so on the times they compute).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

__all__ = ["replay_in_order"]


def replay_in_order(orders: Sequence[Sequence[object]], try_run: Callable[[int, int], bool]) -> list[int]:
    """Run ``orders[r][0], orders[r][1], ...`` on every rank ``r``, visiting the ranks round-robin.

    Args:
        orders: per rank, the items in the order that rank runs them.
        try_run: ``try_run(r, j)`` runs item ``j`` of rank ``r`` and returns True, or returns False without
            running it when it cannot run yet (the rank then waits for the next round).

    Returns:
        Per rank, how many items ran: ``len(orders[r])`` everywhere unless the orders deadlock.
    """
    pos = [0] * len(orders)
    progress = True
    while progress:
        progress = False
        for r, order in enumerate(orders):
            while pos[r] < len(order) and try_run(r, pos[r]):
                pos[r] += 1
                progress = True
    return pos
