"""How many gradient contributions each parameter will receive this step, and how many have arrived.

A parameter is *ready* when every contribution it will get this step has been added to its ``main_grad``.
Counting "once per step" is wrong with split backward: a module used twice in one forward (tied layers) parks
two wgrad tasks, so its hook fires twice; a plain parameter used twice is still accumulated by autograd once
per backward. So the wrapper counts what to expect from the autograd graph of every forward it runs:

* a parameter whose gradient flows through autograd (``skip_backward_post_hook`` false) receives **one**
  contribution per backward pass that reaches its ``AccumulateGrad`` node;
* a parameter whose gradient its module writes itself (``skip_backward_post_hook`` true) receives one
  contribution per autograd node that takes it as an input: each such node parks (or runs, when fused) one wgrad
  task, and each task fires the owner's hook once.

A bucket may start reducing only when all its parameters have every expected contribution.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from typing import Any

import torch

__all__ = ["StepCounts", "count_contributions", "iter_tensors"]


def iter_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor inside ``obj``: a tensor, or any nesting of lists, tuples, dicts and dataclasses."""
    stack = [obj]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            yield item
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif dataclasses.is_dataclass(item) and not isinstance(item, type):
            stack.extend(getattr(item, f.name) for f in dataclasses.fields(item))


def count_contributions(outputs: Any, index_of: dict[int, int], skip: list[bool]) -> dict[int, int]:
    """Expected contributions per managed parameter for one backward pass over ``outputs``' graph.

    Args:
        outputs: what the forward returned (any nesting of tensors).
        index_of: ``id(param) -> index`` of the parameters being counted.
        skip: per index, whether that parameter's gradient bypasses autograd (``skip_backward_post_hook``).

    Returns:
        ``{index: contributions}`` for every managed parameter the graph reaches.
    """
    roots = [t.grad_fn for t in iter_tensors(outputs) if t.requires_grad and t.grad_fn is not None]
    counts: dict[int, int] = {}
    seen: set[Any] = set(roots)
    stack = list(roots)
    while stack:
        node = stack.pop()
        reached: set[int] = set()
        for child, _ in node.next_functions:
            if child is None:
                continue
            variable = getattr(child, "variable", None)
            if variable is not None:
                idx = index_of.get(id(variable))
                if idx is not None:
                    reached.add(idx)
                continue
            if child not in seen:
                seen.add(child)
                stack.append(child)
        for idx in reached:
            if skip[idx]:
                counts[idx] = counts.get(idx, 0) + 1
            else:
                counts[idx] = 1
    return counts


class StepCounts:
    """Per-step bookkeeping: expected and arrived contributions per parameter, missing ones per bucket.

    Args:
        bucket_of: per parameter index, the index of its bucket.
        n_buckets: number of buckets.
    """

    def __init__(self, bucket_of: list[int], n_buckets: int) -> None:
        self.bucket_of = bucket_of
        self._n_buckets = n_buckets
        self.reset()

    def reset(self) -> None:
        n = len(self.bucket_of)
        self.expected = [0] * n
        self.arrived = [0] * n
        #: Whether any forward's graph was counted this step (without one, nothing is launched early).
        self.counted = False
        #: Per bucket: parameters with fewer contributions than expected.
        self.missing = [0] * self._n_buckets
        #: Per bucket: some parameter got more contributions than counted (a forward the wrapper did not
        #: see); such a bucket is reduced only in finish_grad_sync().
        self.unpredictable = [False] * self._n_buckets

    def add_expected(self, counts: dict[int, int]) -> None:
        """Add one forward's counts (from :func:`count_contributions`)."""
        for idx, n in counts.items():
            complete_before = self.arrived[idx] >= self.expected[idx]
            self.expected[idx] += n
            if complete_before and self.arrived[idx] < self.expected[idx]:
                self.missing[self.bucket_of[idx]] += 1
        self.counted = True

    def arrive(self, idx: int) -> int:
        """Record one contribution to parameter ``idx``; returns its bucket."""
        bucket = self.bucket_of[idx]
        self.arrived[idx] += 1
        if self.arrived[idx] == self.expected[idx]:
            self.missing[bucket] -= 1
        elif self.arrived[idx] > self.expected[idx]:
            self.unpredictable[bucket] = True
        return bucket

    def complete(self, bucket: int) -> bool:
        """Whether ``bucket`` has every expected contribution (and its expectations are trustworthy)."""
        return self.counted and self.missing[bucket] == 0 and not self.unpredictable[bucket]

    def unused(self, indices: Iterable[int]) -> list[tuple[int, int]]:
        """``(index, expected)`` of parameters that received no contribution this step.

        Fewer contributions than counted is *not* reported: two forwards joined into one loss are backwarded
        once, so a parameter used by both is accumulated once (its bucket just waits for finish_grad_sync).
        """
        return [(i, self.expected[i]) for i in indices if self.arrived[i] == 0]
