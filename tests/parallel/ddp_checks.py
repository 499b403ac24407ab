"""Checks run inside spawned gloo ranks (imported by the children, so not a test module itself).

Each check builds fresh models, runs one scenario on every rank, and raises on a wrong result. ``run_checks``
runs a list of them in one process group and returns ``{check: None | remote traceback}`` so that each check
is reported as its own pytest test while the process start-up is paid once. Gradient checks live here, misuse
checks in :mod:`tests.parallel.ddp_error_checks`, models in :mod:`tests.parallel.ddp_models`.
"""

from __future__ import annotations

import traceback

import torch
import torch.distributed as dist
from torch import nn

import splitgrad
from splitgrad.parallel import DistributedDataParallel as DDP
from splitgrad.testing import assert_grads_close, main_grads, plain_autograd_grads, shard
from tests.parallel.ddp_error_checks import (
    check_negative_local_grads_rejected,
    check_pending_and_late_errors,
    check_timeout_is_an_error,
    check_unused_parameter_error,
)
from tests.parallel.ddp_launch_checks import (
    check_backward_dw_completes_buckets_front_to_back,
    check_buckets_launch_when_ready,
)
from tests.parallel.ddp_models import (
    BATCH,
    D_OUT,
    F64,
    Routed,
    Tied,
    assert_same_on_all_ranks,
    batch,
    deep_model,
    fusible_ops_model,
    loss_of,
    mixed_dtype_model,
    mixed_model,
    one_step,
    reference,
)


def check_matches_reference(rank: int, world: int) -> None:
    """Delayed/immediate x fused/unfused: averaged main_grad and .grad equal the float64 full-batch grads."""
    ref = reference()
    for delay in (False, True):
        for fused in (False, True):
            what = f"{delay=} {fused=}"
            model, ddp = one_step(rank, world, delay, fused)
            n_buckets = len(ddp.buckets)
            if n_buckets < 3:
                raise AssertionError(f"{what}: expected several buckets, got {n_buckets}")
            ddp.finish_grad_sync()
            if ddp.last_launched_early != n_buckets:
                raise AssertionError(
                    f"{what}: only {ddp.last_launched_early}/{n_buckets} overlapped backward"
                )
            assert_grads_close(main_grads(model), ref, what=what)
            grads = {n: p.grad for n, p in model.named_parameters()}
            assert_grads_close(grads, ref, what=f"{what} .grad")
            assert_same_on_all_ranks(ddp)
            for p in model.parameters():
                if p.grad.data_ptr() != p.main_grad.data_ptr():
                    raise AssertionError(f"{what}: .grad is not a view of main_grad")


def check_broadcast_params(rank: int, world: int) -> None:
    """Ranks initialised differently hold rank 0's parameters and buffers after wrapping (and on demand)."""
    model = nn.Sequential(mixed_model(True, False, seed=rank), nn.BatchNorm1d(D_OUT, dtype=F64))
    model[1].running_mean.fill_(float(rank))
    ddp = DDP(model, grad_reduce_dtype=None)
    expected = nn.Sequential(mixed_model(True, False, seed=0), nn.BatchNorm1d(D_OUT, dtype=F64)).state_dict()
    for name, value in model.state_dict().items():
        want = torch.zeros_like(value) if name == "1.running_mean" else expected[name]
        torch.testing.assert_close(value, want, rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")
    with torch.no_grad():
        model[0][0].weight.add_(float(rank))
    ddp.broadcast_params()
    torch.testing.assert_close(model[0][0].weight, expected["0.0.weight"], rtol=0, atol=0)


def check_overlap_off_and_sum_then_divide(rank: int, world: int) -> None:
    """overlap_grad_reduce=False issues everything in finish; average_in_collective=False gives the same bits."""
    ref = reference()
    model_a, ddp_a = one_step(rank, world, True, False, overlap_grad_reduce=False)
    if ddp_a.launch_order:
        raise AssertionError(f"overlap off but buckets {ddp_a.launch_order} launched during backward")
    ddp_a.finish_grad_sync()
    model_b, ddp_b = one_step(rank, world, True, False, average_in_collective=False)
    ddp_b.finish_grad_sync()
    assert_grads_close(main_grads(model_a), ref, what="overlap off")
    if world == 2:  # x/2 + y/2 == (x + y)/2 exactly; not so for 3
        assert_grads_close(main_grads(model_b), main_grads(model_a), exact=True, what="sum-then-divide")
    else:
        assert_grads_close(main_grads(model_b), ref, what="sum-then-divide")


def check_matches_torch_ddp(rank: int, world: int) -> None:
    """float32: our averaged grads equal torch DDP's on the same model (bitwise with 2 ranks)."""
    x = shard(batch(dtype=torch.float32), rank, world)
    theirs_model = mixed_model(False, False, dtype=torch.float32)
    theirs = nn.parallel.DistributedDataParallel(theirs_model)
    loss_of(theirs(x)).backward()
    expected = {n: p.grad for n, p in theirs_model.named_parameters()}
    for delay, fused in ((False, False), (True, False), (True, True), (False, True)):
        model = mixed_model(delay, fused, dtype=torch.float32)
        ddp = DDP(model, bucket_size=300)
        loss_of(ddp(x)).backward()
        splitgrad.backward_dw(ddp)
        ddp.finish_grad_sync()
        exact = (
            world == 2 and not fused
        )  # fused accumulates with addmm into the buffer: same math, other kernel
        assert_grads_close(
            main_grads(model),
            expected,
            exact=exact,
            rtol=1e-5,
            atol=1e-6,
            what=f"vs torch DDP {delay=} {fused=}",
        )


def check_no_sync_zero_bubble_order(rank: int, world: int) -> None:
    """3 microbatches; B of the first two inside no_sync, every W after the block (zero-bubble style).

    Deferred W of microbatch 0 arriving after no_sync must not complete a bucket: expectations count every
    forward of the step.
    """
    n_mb = 3
    x = batch(n=BATCH * n_mb)
    ref = plain_autograd_grads(mixed_model(False, False), lambda m: loss_of(m(x)))
    for fused in (False, True):
        model = mixed_model(True, fused)
        ddp = DDP(model, grad_reduce_dtype=None, bucket_size=300)
        mine = shard(x, rank, world).chunk(n_mb)
        bundles = []
        with ddp.no_sync():
            for mb in range(n_mb - 1):
                with splitgrad.capture_wgrad() as bundle:
                    (loss_of(ddp(mine[mb])) / n_mb).backward()
                bundles.append(bundle)
        with splitgrad.capture_wgrad() as bundle:
            (loss_of(ddp(mine[-1])) / n_mb).backward()
        bundles.append(bundle)
        if ddp.launch_order:
            raise AssertionError(f"{fused=}: buckets {ddp.launch_order} launched before any W ran")
        with torch.no_grad():
            for i, bundle in enumerate(bundles):
                bundle.run()
                if i < n_mb - 1 and ddp.launch_order:
                    raise AssertionError(f"{fused=}: buckets {ddp.launch_order} launched before the last W")
        ddp.finish_grad_sync()
        if ddp.last_launched_early != len(ddp.buckets):
            raise AssertionError(f"{fused=}: {ddp.last_launched_early}/{len(ddp.buckets)} overlapped")
        assert_grads_close(main_grads(model), ref, what=f"no_sync {fused=}")


def check_buckets_complete_out_of_order(rank: int, world: int) -> None:
    """W in registration order (the reverse of the layout): buckets complete back to front.

    Collectives must still be issued in bucket order (or ranks could pair different buckets), the last bucket
    to complete releases all, and the result is exact. Ranks also use *different* W orders here.
    """
    ref = reference(model_fn=deep_model)
    model = deep_model(True, False)
    ddp = DDP(model, grad_reduce_dtype=None, bucket_size=1)
    if len(ddp.buckets) != 8:
        raise AssertionError(f"expected one bucket per parameter, got {len(ddp.buckets)}")
    loss_of(ddp(shard(batch(), rank, world))).backward()
    layers = list(model)
    order = layers if rank % 2 == 0 else [layers[1], layers[0], layers[2], layers[3]]
    with torch.no_grad():
        for layer in order[:-1]:
            layer.backward_dw()
        if ddp.launch_order:
            raise AssertionError(f"buckets {ddp.launch_order} launched before bucket 0 completed")
        order[-1].backward_dw()
    if ddp.launch_order != list(range(8)):
        raise AssertionError(f"collectives issued out of bucket order: {ddp.launch_order}")
    ddp.finish_grad_sync()
    assert_grads_close(main_grads(model), ref, what="out of order")


def check_tied_modules(rank: int, world: int) -> None:
    """A module used twice fires its wgrad hook twice; its bucket waits for both, never launching early."""
    ref = reference(model_fn=Tied)
    for delay in (False, True):
        for fused in (False, True):
            model = Tied(delay, fused)
            ddp = DDP(model, grad_reduce_dtype=None, bucket_size=1)
            loss_of(ddp(shard(batch(), rank, world))).backward()
            if delay:
                with torch.no_grad():
                    model.head.backward_dw()
                    model.split.backward_dw()  # first of two tasks: its bucket must not launch yet
                    split_buckets = {
                        b.index for b in ddp.buckets if any(p is model.split.weight for p in b.params)
                    }
                    if split_buckets & set(ddp.launch_order):
                        raise AssertionError("tied module's bucket launched after one of its two W tasks")
                    model.split.backward_dw()
            ddp.finish_grad_sync()
            if ddp.last_launched_early != len(ddp.buckets):
                raise AssertionError(f"{delay=} {fused=}: not all buckets overlapped")
            assert_grads_close(main_grads(model), ref, what=f"tied {delay=} {fused=}")


def check_two_forwards_one_backward(rank: int, world: int) -> None:
    """Two forwards joined into one loss: autograd accumulates a plain parameter once for both, so fewer
    contributions than forwards is legitimate; the buckets wait for finish_grad_sync(), the result is exact."""
    x = batch(n=2 * BATCH)
    ref = plain_autograd_grads(mixed_model(False, False), lambda m: loss_of(m(x)))
    for delay in (False, True):
        model = mixed_model(delay, False)
        ddp = DDP(model, grad_reduce_dtype=None, bucket_size=300)
        first, second = shard(x, rank, world).chunk(2)
        ((loss_of(ddp(first)) + loss_of(ddp(second))) / 2).backward()
        splitgrad.backward_dw(ddp)
        ddp.finish_grad_sync()
        assert_grads_close(main_grads(model), ref, what=f"joined forwards {delay=}")


def check_reduce_scatter(rank: int, world: int) -> None:
    """Reduce-scatter leaves the average in this rank's shard of every bucket."""
    ref = reference()
    model, ddp = one_step(rank, world, True, True, reduce_scatter=True)
    ddp.finish_grad_sync()
    # Build the expected flat buckets from the reference, then compare only the local shards.
    names = {id(p): n for n, p in model.named_parameters()}
    for bucket, shard_ in zip(ddp.buckets, ddp.local_grad_shards()):
        flat = torch.zeros_like(bucket.data)
        for p, (lo, hi) in zip(bucket.params, bucket.param_ranges):
            flat[lo:hi] = ref[names[id(p)]].flatten()
        torch.testing.assert_close(shard_, bucket.shard(rank, world), rtol=0, atol=0)
        torch.testing.assert_close(shard_, flat.view(world, -1)[rank], rtol=1e-10, atol=1e-12)
    if any(p.grad is not None for p in model.parameters()):
        raise AssertionError("reduce_scatter must not expose full-size .grad")


def check_training_loop_matches_torch_ddp(rank: int, world: int) -> None:
    """A few SGD-momentum steps: parameters match torch DDP's (bitwise with 2 ranks, unfused)."""
    steps = 3
    theirs_model = mixed_model(False, False, dtype=torch.float32)
    theirs = nn.parallel.DistributedDataParallel(theirs_model)
    opt = torch.optim.SGD(theirs.parameters(), lr=0.1, momentum=0.9)
    for step in range(steps):
        opt.zero_grad()
        loss_of(theirs(shard(batch(step, torch.float32), rank, world))).backward()
        opt.step()
    # Every way of zeroing must work: the wrapper's, the optimizer's (None -> main_grad zeroed at the next
    # forward), and the optimizer's in place (zeroes the exposed views, i.e. main_grad itself).
    for fused, zero in (
        (False, "buffer"),
        (True, "optimizer"),
        (False, "optimizer in place"),
        (True, "module"),
    ):
        model = mixed_model(True, fused, dtype=torch.float32)
        ddp = DDP(model, bucket_size=300)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
        guard = splitgrad.guard_optimizer(optimizer, ddp)
        for step in range(steps):
            if zero == "buffer":
                ddp.zero_grad_buffer()
            elif zero == "module":
                ddp.zero_grad()
            else:
                optimizer.zero_grad(set_to_none=zero == "optimizer")
            loss_of(ddp(shard(batch(step, torch.float32), rank, world))).backward()
            splitgrad.backward_dw(ddp)
            ddp.finish_grad_sync()
            optimizer.step()
        guard.remove()
        tol = {"rtol": 0.0, "atol": 0.0} if world == 2 and not fused else {"rtol": 1e-5, "atol": 1e-6}
        for (name, mine), theirs_p in zip(model.named_parameters(), theirs_model.parameters()):
            torch.testing.assert_close(mine, theirs_p, **tol, msg=lambda m, n=name, z=zero: f"{z}: {n}: {m}")


def check_rank_dependent_usage(rank: int, world: int) -> None:
    """Ranks use different experts, so their buckets complete in different orders: collectives still pair
    up (bucket order) and each expert gets the sum of the contributing ranks' gradients / world size."""
    x = batch()
    expected: dict[str, torch.Tensor] = {}
    for r in range(world):
        ref_model = Routed(False, False)
        loss_of(ref_model(shard(x, r, world), r % 2)).backward()
        for name, p in ref_model.named_parameters():
            if p.grad is not None:
                expected[name] = expected.get(name, 0) + p.grad / world
    for fused in (False, True):
        model = Routed(True, fused)
        ddp = DDP(model, grad_reduce_dtype=None, allow_unused_parameters=True, bucket_size=1)
        loss_of(ddp(shard(x, rank, world), route=rank % 2)).backward()
        splitgrad.backward_dw(ddp)
        ddp.finish_grad_sync()
        if ddp.last_launch_order != list(range(len(ddp.buckets))):
            raise AssertionError(f"launch order {ddp.last_launch_order}")
        assert_grads_close(main_grads(model), expected, what=f"routed {fused=}")
        assert_same_on_all_ranks(ddp)


def check_mixed_dtypes(rank: int, world: int) -> None:
    """bf16 params reduce in an fp32 buffer, fp32 in the same one, float64 keeps its own (never narrowed).

    The average equals the float64 mean of every rank's local fp32 gradient; the exposed bf16 ``.grad`` is
    the averaged fp32 ``main_grad`` cast once.
    """
    x = shard(batch(dtype=torch.float32), rank, world)
    for delay, fused in ((False, False), (True, True)):
        local_model = mixed_dtype_model(delay, fused)
        local = DDP(local_model)
        with local.no_sync():
            loss_of(local(x)).backward()
            splitgrad.backward_dw(local)
        mine = main_grads(local_model)
        expected = {}
        for name, g in mine.items():
            gathered = [torch.empty_like(g) for _ in range(world)]
            dist.all_gather(gathered, g)
            expected[name] = torch.stack([t.to(F64) for t in gathered]).mean(0)
        model = mixed_dtype_model(delay, fused)
        ddp = DDP(model)
        if sorted(str(b.dtype) for b in ddp.grad_buffers) != ["torch.float32", "torch.float64"]:
            raise AssertionError(f"buffers {ddp.grad_buffers}")
        loss_of(ddp(x)).backward()
        splitgrad.backward_dw(ddp)
        ddp.finish_grad_sync()
        got = main_grads(model)
        for name, g in got.items():
            want_dtype = F64 if name.startswith("5.") else torch.float32
            if g.dtype != want_dtype:
                raise AssertionError(f"{name}: main_grad dtype {g.dtype}, expected {want_dtype}")
        assert_grads_close(got, expected, rtol=1e-6, atol=1e-7, what=f"mixed dtypes {delay=} {fused=}")
        bf16_weight = model[1].weight
        if bf16_weight.grad.dtype != torch.bfloat16 or not torch.equal(
            bf16_weight.grad, bf16_weight.main_grad.to(torch.bfloat16)
        ):
            raise AssertionError("bf16 .grad is not the averaged main_grad cast to bf16")
        # Zeroing the exposed grads in place (optimizer.zero_grad(set_to_none=False)) must zero main_grad,
        # for views and for the bf16 cast copy alike: the same step again gives the same average.
        for p in model.parameters():
            p.grad.zero_()
        loss_of(ddp(x)).backward()
        splitgrad.backward_dw(ddp)
        ddp.finish_grad_sync()
        assert_grads_close(main_grads(model), expected, rtol=1e-6, atol=1e-7, what=f"second step {delay=}")


def check_fusible_ops(rank: int, world: int) -> None:
    """splitgrad.ops (one autograd Function for several ops) follow the same hook contract as modules."""
    ref = reference(model_fn=fusible_ops_model)
    for delay in (False, True):
        for fused in (False, True):
            model = fusible_ops_model(delay, fused)
            ddp = DDP(model, grad_reduce_dtype=None, bucket_size=100)
            loss_of(ddp(shard(batch(), rank, world))).backward()
            splitgrad.backward_dw(ddp)
            ddp.finish_grad_sync()
            if ddp.last_launched_early != len(ddp.buckets):
                raise AssertionError(f"{delay=} {fused=}: not all buckets overlapped")
            assert_grads_close(main_grads(model), ref, what=f"ops {delay=} {fused=}")


#: Run with 3 ranks too: where a non-power-of-two world changes the arithmetic (averages, ring order, shard
#: sizes) or the rank-to-rank ordering.
ALL_WORLDS = [
    check_matches_reference,
    check_overlap_off_and_sum_then_divide,
    check_no_sync_zero_bubble_order,
    check_buckets_complete_out_of_order,
    check_tied_modules,
    check_reduce_scatter,
    check_training_loop_matches_torch_ddp,
    check_rank_dependent_usage,
]


#: Two ranks are enough (and keep CI fast); the timeout check must stay last (it breaks its own group).
WORLD2_ONLY = [
    check_broadcast_params,
    check_negative_local_grads_rejected,
    check_matches_torch_ddp,
    check_two_forwards_one_backward,
    check_mixed_dtypes,
    check_fusible_ops,
    check_buckets_launch_when_ready,
    check_backward_dw_completes_buckets_front_to_back,
    check_unused_parameter_error,
    check_pending_and_late_errors,
    check_timeout_is_an_error,
]


def run_checks(rank: int, world: int, names: list[str]) -> dict[str, str | None]:
    """Run the named checks in order; after the first failure the rest are reported as not run."""
    table = {f.__name__: f for f in ALL_WORLDS + WORLD2_ONLY}
    results: dict[str, str | None] = {}
    failed = None
    for name in names:
        if failed is not None:
            results[name] = f"not run: {failed} failed first on rank {rank}"
            continue
        try:
            table[name](rank, world)
            results[name] = None
        except Exception:
            results[name] = traceback.format_exc()
            failed = name
    return results
