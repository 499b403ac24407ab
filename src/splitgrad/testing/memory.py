"""Device-agnostic allocation accounting for tests and benchmarks (CPU has no ``max_memory_allocated``).

:class:`AllocationTracker` is a ``TorchDispatchMode`` that sees every aten op while active and records each
*new* output storage (not an input, not a view or in-place result). That proves claims such as "the fused
wgrad path allocates nothing weight-sized" deterministically, without timings or allocator statistics.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["AllocationTracker"]


class AllocationTracker(TorchDispatchMode):
    """Record ``(op name, nbytes)`` of every new tensor storage created inside the ``with`` block."""

    def __init__(self) -> None:
        super().__init__()
        self.allocations: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = {
            t.untyped_storage().data_ptr()
            for t in tree_flatten((args, kwargs))[0]
            if isinstance(t, torch.Tensor)
        }
        out = func(*args, **kwargs)
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                nbytes = t.untyped_storage().nbytes()
                if nbytes:
                    self.allocations.append((str(func), nbytes))
        return out

    @property
    def largest_bytes(self) -> int:
        """The largest single new storage (0 when nothing was allocated)."""
        return max((n for _, n in self.allocations), default=0)

    @property
    def total_bytes(self) -> int:
        """Sum of all new storages (an upper bound on what the block needed at once)."""
        return sum(n for _, n in self.allocations)
