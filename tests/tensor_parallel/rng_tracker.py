"""A CPU stand-in for Megatron's ``CudaRNGStatesTracker``: named RNG states swapped in by ``fork(name)``.

Same shape as Megatron's (``add(name, seed)``, ``fork(name="model-parallel-rng")``), on torch's CPU
generator, so TE's ``get_rng_state_tracker`` keyword can be tested without a GPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

DEFAULT_NAME = "model-parallel-rng"


class CPURNGStatesTracker:
    """Named CPU RNG states; ``fork`` runs a block on one of them and restores the default generator."""

    def __init__(self) -> None:
        self.states: dict[str, torch.Tensor] = {}

    def add(self, name: str, seed: int) -> None:
        outer = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states[name] = torch.get_rng_state()
        torch.set_rng_state(outer)

    @contextlib.contextmanager
    def fork(self, name: str = DEFAULT_NAME) -> Iterator[None]:
        if name not in self.states:
            raise KeyError(f"CPURNGStatesTracker: no state {name!r} (have {sorted(self.states)})")
        outer = torch.get_rng_state()
        torch.set_rng_state(self.states[name])
        try:
            yield
        finally:
            self.states[name] = torch.get_rng_state()
            torch.set_rng_state(outer)


def megatron_tracker(tp_rank: int, seed: int = 1234) -> CPURNGStatesTracker:
    """Megatron's seeding: the model-parallel state is ``seed + 2718 + tp_rank``, so TP shards differ."""
    tracker = CPURNGStatesTracker()
    tracker.add(DEFAULT_NAME, seed + 2718 + tp_rank)
    tracker.add("expert-parallel-rng", seed + 1000 + tp_rank)
    return tracker
