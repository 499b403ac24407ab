"""HSDP checks (a 2-D FSDP2 mesh, replicate=2 x shard=2) run inside the package's 4-rank gloo spawn.

Why: under HSDP FSDP2 reduce-scatters a group's gradients over the ``shard`` dim and then all-reduces the
result over the ``replicate`` dim. ``defer_fsdp_reduction`` drives that same reduction later (at the group's
last W, at ``finish()`` or on a background thread), so a skipped all-reduce, a gradient reduced twice, or the
all-reduce flags read at the wrong time would all show here: sharded ``.grad`` bitwise against FSDP2 immediate
mode on the same mesh, ``full_tensor()`` against the float64 single-process reference.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Replicate, Shard

import splitgrad
from splitgrad.parallel import defer_fsdp_reduction
from tests.fsdp.fsdp_checks import (
    assert_grads,
    build,
    data,
    full,
    loss_of,
    reference,
    shard_model,
    sharded_grads,
)

MODES = ("last_w", "finish", "async")


def hsdp_mesh(world: int) -> DeviceMesh:
    """``(replicate=2, shard=world // 2)``: ranks {0, 1} and {2, 3} each hold one full copy, sharded in two."""
    if world % 2:
        raise ValueError(f"HSDP checks need an even world size, got {world=}")
    return init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))


def hsdp_step(
    rank: int,
    mesh: DeviceMesh,
    mode: str | None,
    *,
    order: str,
    all_reduce_each: bool = False,
    sync_off_before_finish: bool = False,
) -> torch.nn.Module:
    """Two microbatches on the HSDP mesh; ``mode=None`` is FSDP2 immediate mode, else delayed + that mode.

    ``order``: ``"BW"`` (W after each B) or ``"BBW"`` (all W at the end). ``all_reduce_each=False``: gradient
    sync off for the first microbatch (no reduce-scatter, no all-reduce); True: sync on for both, the first
    reduce-scatters but skips the all-reduce (``set_requires_all_reduce(False)``, HSDP's accumulation mode).
    ``sync_off_before_finish``: after the last W, turn gradient sync off (as the next step's first microbatch
    would) before ``finish()``: the reduction due must still run, with the flags of its last W.
    """
    model = shard_model(build(mode is not None), mesh=mesh)
    handle = None if mode is None else defer_fsdp_reduction(model, mode=mode, timeout=120)
    for mb in range(2):
        last = mb == 1
        if all_reduce_each:
            model.set_requires_gradient_sync(True)
            model.set_requires_all_reduce(last)
        else:
            model.set_requires_gradient_sync(last)
        loss_of(model(data(rank, mb))).backward()
        if handle is not None and order == "BW":
            splitgrad.backward_dw(model)
    if handle is not None:
        splitgrad.backward_dw(model)
        if sync_off_before_finish:
            model.set_requires_gradient_sync(False)
            model.set_requires_all_reduce(False)
            if handle.in_flight:  # the setters join a background reduction that reads these flags
                raise AssertionError(f"{mode=}: {handle.in_flight=} after set_requires_gradient_sync")
        handle.finish()
        if handle.held_gradients or handle.in_flight or splitgrad.pending_wgrad(model):
            raise AssertionError(f"{mode=} {order=}: left {handle.held_gradients=} {handle.in_flight=}")
        handle.remove()
    model.set_requires_gradient_sync(True)
    return model


def check_hsdp_modes(rank: int, world: int) -> None:
    """Each mode, W after each B or all at the end, sync on the last microbatch only: bitwise = immediate HSDP,
    ``full_tensor()`` = float64 reference; the gradients really are 2-D (replicated x sharded) DTensors."""
    mesh = hsdp_mesh(world)
    imm = sharded_grads(hsdp_step(rank, mesh, None, order="BW"))
    for name, grad in imm.items():
        if grad.device_mesh.ndim != 2 or tuple(grad.placements) != (Replicate(), Shard(0)):
            raise AssertionError(f"{name}: not an HSDP gradient: {grad.device_mesh} {grad.placements}")
    ref = reference(world, 2)
    assert_grads(full(imm), ref, "immediate HSDP vs float64 reference", bitwise=False)
    for mode in MODES:
        for order in ("BW", "BBW"):
            what = f"HSDP {mode=} {order=}"
            dly = sharded_grads(hsdp_step(rank, mesh, mode, order=order))
            assert_grads(dly, imm, f"{what}: delayed vs immediate", bitwise=True)
            assert_grads(full(dly), ref, f"{what}: vs float64 reference", bitwise=False)


def check_hsdp_all_reduce_on_last_only(rank: int, world: int) -> None:
    """HSDP's accumulation mode: reduce-scatter every microbatch, all-reduce only the last
    (``set_requires_all_reduce``). W after each B: bitwise = immediate; all W at the end: one reduction of the
    summed gradient (another summation order), = float64 reference."""
    mesh = hsdp_mesh(world)
    imm = sharded_grads(hsdp_step(rank, mesh, None, order="BW", all_reduce_each=True))
    ref = reference(world, 2)
    assert_grads(full(imm), ref, "immediate, all-reduce on the last only", bitwise=False)
    for mode in MODES:
        for order in ("BW", "BBW"):
            what = f"HSDP all-reduce on the last only {mode=} {order=}"
            dly = sharded_grads(hsdp_step(rank, mesh, mode, order=order, all_reduce_each=True))
            if order == "BW":
                assert_grads(dly, imm, f"{what}: delayed vs immediate", bitwise=True)
            assert_grads(full(dly), ref, f"{what}: vs float64 reference", bitwise=False)
    # Reduce-scattered, all-reduce still owed: uninstalling or handing back to FSDP2 would lose it.
    model = shard_model(build(True), mesh=mesh)
    handle = defer_fsdp_reduction(model)
    model.set_requires_all_reduce(False)
    loss_of(model(data(rank, 0))).backward()
    splitgrad.backward_dw(model)
    for call, text in (
        (handle.remove, "HSDP all-reduce skipped"),
        (handle.release_to_fsdp, "awaiting their HSDP"),
    ):
        try:
            call()
        except RuntimeError as exc:
            if text not in str(exc):
                raise
        else:
            raise AssertionError(f"{call.__name__}() with an HSDP all-reduce pending was accepted")
    model.set_requires_all_reduce(True)
    loss_of(model(data(rank, 1))).backward()
    splitgrad.backward_dw(model)
    assert_grads(sharded_grads(model), imm, "pending all-reduce then completed", bitwise=True)
    handle.remove()


def check_hsdp_sync_flags_changed_before_finish(rank: int, world: int) -> None:
    """Gradient sync and all-reduce turned off after the last W, before ``finish()`` (or while the background
    reduction may still run): the reduction still happens, as decided at the last W; bitwise = immediate."""
    mesh = hsdp_mesh(world)
    imm = sharded_grads(hsdp_step(rank, mesh, None, order="BW"))
    for mode in ("finish", "async"):
        dly = sharded_grads(hsdp_step(rank, mesh, mode, order="BW", sync_off_before_finish=True))
        assert_grads(dly, imm, f"HSDP {mode=}: sync off before finish() vs immediate", bitwise=True)


def check_hsdp_wrong_answer_rejected(rank: int, world: int) -> None:
    """Negative: the gradient without the replicate all-reduce, or counted twice, fails the comparisons."""
    mesh = hsdp_mesh(world)
    dly = hsdp_step(rank, mesh, "finish", order="BW")
    got = sharded_grads(dly)
    ref = reference(world, 2)
    # Reduce-scattered over the shard dim only: each replica group's own mean (ranks {0,1} or {2,3}).
    replica = rank // (world // 2)
    shard_ranks = [replica * (world // 2) + r for r in range(world // 2)]
    only_shard = build(False)
    total = sum(loss_of(only_shard(data(r, mb))) for r in shard_ranks for mb in range(2)) / len(shard_ranks)
    total.backward()
    wrong = {
        "no replicate all-reduce": {n: p.grad for n, p in only_shard.named_parameters()},
        "counted twice": {n: 2 * g for n, g in ref.items()},
    }
    for what, want in wrong.items():
        try:
            assert_grads(full(got), want, what, bitwise=False)
        except AssertionError:
            continue
        raise AssertionError(f"HSDP: a gradient {what} was accepted")
    doubled = {n: g * 2 for n, g in got.items()}
    try:
        assert_grads(doubled, sharded_grads(hsdp_step(rank, mesh, None, order="BW")), "doubled", bitwise=True)
    except AssertionError:
        pass
    else:
        raise AssertionError("HSDP: a doubled sharded gradient was accepted as immediate mode")


CHECKS = [
    check_hsdp_modes,
    check_hsdp_all_reduce_on_last_only,
    check_hsdp_sync_flags_changed_before_finish,
    check_hsdp_wrong_answer_rejected,
]
