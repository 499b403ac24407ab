"""DDP checks that misuse must be a clear error (or a rejected wrong answer), never a silent result or a hang.

Run inside spawned ranks by :func:`tests.parallel.ddp_checks.run_checks`.
"""

from __future__ import annotations

import datetime
import re
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

import splitgrad
from splitgrad.parallel import DistributedDataParallel as DDP
from splitgrad.testing import assert_grads_close, main_grads, plain_autograd_grads, shard
from tests.parallel.ddp_models import (
    WithUnused,
    batch,
    loss_of,
    mixed_model,
    reference,
)


def check_negative_local_grads_rejected(rank: int, world: int) -> None:
    """Not trivially passing: an unsynchronised (local-batch) gradient must fail the reference check."""
    ref = reference()
    model = mixed_model(True, False)
    ddp = DDP(model, grad_reduce_dtype=None)
    with ddp.no_sync():
        loss_of(ddp(shard(batch(), rank, world))).backward()
        splitgrad.backward_dw(ddp)
    if ddp.launch_order:
        raise AssertionError(f"no_sync launched buckets {ddp.launch_order}")
    try:
        assert_grads_close(main_grads(model), ref, what="local")
    except AssertionError:
        return
    raise AssertionError("a local, unaveraged gradient passed the full-batch reference check")


def check_unused_parameter_error(rank: int, world: int) -> None:
    """An unused parameter is a clear error naming it; allow_unused_parameters reduces it as zeros."""
    model = WithUnused(True, False)
    ddp = DDP(model, grad_reduce_dtype=None)
    loss_of(ddp(shard(batch(), rank, world))).backward()
    splitgrad.backward_dw(ddp)
    try:
        ddp.finish_grad_sync()
    except RuntimeError as exc:
        named = set(re.findall(r"\b(\w+\.\w+) \(", str(exc)))
        if named != {"unused.weight", "unused.bias"}:
            raise AssertionError(f"error does not name exactly the unused parameters: {exc}") from exc
    else:
        raise AssertionError("finish_grad_sync() accepted a parameter that never got a gradient")
    ddp.zero_grad_buffer()

    x = batch()
    ref = plain_autograd_grads(WithUnused(False, False).used, lambda m: loss_of(m(x)))
    model = WithUnused(True, False)
    ddp = DDP(model, grad_reduce_dtype=None, allow_unused_parameters=True)
    loss_of(ddp(shard(x, rank, world))).backward()
    splitgrad.backward_dw(ddp)
    ddp.finish_grad_sync()
    assert_grads_close(main_grads(model.used), ref, what="used layer")
    if torch.count_nonzero(model.unused.weight.main_grad) or torch.count_nonzero(model.unused.bias.main_grad):
        raise AssertionError("an unused parameter's averaged main_grad is not zero")


def check_pending_and_late_errors(rank: int, world: int) -> None:
    """Pending wgrad at finish, a forward while reductions run, finish inside no_sync: all clear errors."""
    model = mixed_model(True, False)
    ddp = DDP(model, grad_reduce_dtype=None)
    loss_of(ddp(shard(batch(), rank, world))).backward()
    _expect_error(ddp.finish_grad_sync, "pending")
    splitgrad.backward_dw(ddp)
    with ddp.no_sync():
        _expect_error(ddp.finish_grad_sync, "no_sync")
    _expect_error(lambda: ddp(batch()), "finish_grad_sync() before the next step")
    ddp.finish_grad_sync()

    # A backward that bypasses the wrapper right after finish would add to the exposed averages.
    model = mixed_model(False, False)
    ddp = DDP(model, grad_reduce_dtype=None)
    x = shard(batch(), rank, world)
    loss_of(ddp(x)).backward()
    ddp.finish_grad_sync()
    _expect_error(lambda: loss_of(ddp.module(x)).backward(), "arrived after finish_grad_sync()")
    ddp.zero_grad_buffer()  # recovers: a clean step gives the reference again
    loss_of(ddp(x)).backward()
    ddp.finish_grad_sync()
    assert_grads_close(main_grads(model), reference(), what="after recovery")


def _expect_error(fn: Callable[[], object], needle: str) -> None:
    try:
        fn()
    except RuntimeError as exc:
        if needle not in str(exc):
            raise AssertionError(f"error lacks {needle!r}: {exc}") from exc
        return
    raise AssertionError(f"expected a RuntimeError mentioning {needle!r}")


def check_timeout_is_an_error(rank: int, world: int) -> None:
    """A rank that never issues its collective makes the peer raise within the timeout, not hang."""
    short = dist.new_group(timeout=datetime.timedelta(seconds=4))
    model = mixed_model(True, False)
    ddp = DDP(model, process_group=short, grad_reduce_dtype=None, timeout=3.0)
    if rank == 0:
        loss_of(ddp(shard(batch(), rank, world))).backward()
        splitgrad.backward_dw(ddp)
        start = time.monotonic()
        _expect_error(ddp.finish_grad_sync, "did not complete on rank 0")
        elapsed = time.monotonic() - start
        if elapsed > 10:
            raise AssertionError(f"timeout took {elapsed:.1f} s")
    dist.barrier()  # the default group is healthy; rank 1 waits here for rank 0's error
