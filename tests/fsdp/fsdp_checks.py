"""FSDP2 checks run inside spawned gloo ranks (imported by the children; not a test module itself).

Each check builds a fresh float64 model from one seed on every rank, shards it with ``fully_shard``, runs one
scenario with per-rank data and raises on a wrong result: sharded ``.grad`` compared bitwise with FSDP2 in
immediate mode and, via ``full_tensor()``, with a float64 single-process reference (the average over ranks'
losses, which is what FSDP2's reduce-scatter divides to).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import splitgrad
from splitgrad.parallel import FSDPStage, defer_fsdp_reduction, fsdp_reduction_handle
from tests.helpers import expect_error

F64 = torch.float64
D = 8


def build(delay: bool, *, seed: int = 0, dtype: torch.dtype = F64) -> nn.Sequential:
    """LayerNorm (plain torch: FSDP2's own path) -> Linear -> GELU -> Linear -> LayerNormLinear, all ``D`` wide."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.LayerNorm(D, dtype=dtype),
        splitgrad.Linear(D, 2 * D, delay_wgrad_compute=delay, params_dtype=dtype),
        nn.GELU(),
        splitgrad.Linear(2 * D, D, delay_wgrad_compute=delay, params_dtype=dtype),
        splitgrad.LayerNormLinear(D, D, delay_wgrad_compute=delay, params_dtype=dtype),
    )


def shard_model(model: nn.Sequential, **kw) -> nn.Sequential:
    for i in (1, 3, 4):
        fully_shard(model[i], **kw)
    fully_shard(model, **kw)  # the root keeps the LayerNorm: a group with no deferred parameter
    return model


def data(rank: int, mb: int, dtype: torch.dtype = F64) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + 17 * rank + mb)
    return torch.randn(6, D, generator=g, dtype=dtype)


def loss_of(y: torch.Tensor) -> torch.Tensor:
    return y.square().mean() + y.sum() * 0.01


def reference(world: int, n_mb: int) -> dict[str, torch.Tensor]:
    """float64 plain-autograd gradients of the mean over ranks of the summed microbatch losses."""
    model = build(False)
    total = sum(loss_of(model(data(r, mb))) for r in range(world) for mb in range(n_mb)) / world
    total.backward()
    return {n: p.grad for n, p in model.named_parameters()}


def sharded_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad for n, p in model.named_parameters()}


def full(grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: g.full_tensor() for n, g in grads.items()}


def assert_grads(got: dict, want: dict, what: str, *, bitwise: bool, rtol: float = 1e-12) -> None:
    if got.keys() != want.keys():
        raise AssertionError(f"{what}: parameters differ {sorted(got)} vs {sorted(want)}")
    for name in want:
        if got[name] is None or want[name] is None:
            raise AssertionError(f"{what}: {name} has no gradient (got {got[name] is None=})")
        a = got[name].to_local() if hasattr(got[name], "to_local") else got[name]
        b = want[name].to_local() if hasattr(want[name], "to_local") else want[name]
        tol = {"rtol": 0, "atol": 0} if bitwise else {"rtol": rtol, "atol": rtol}
        torch.testing.assert_close(a, b, **tol, msg=lambda m, n=name: f"{what}: {n}: {m}")


def run_steps(rank: int, delay: bool, *, n_mb: int, order: str, shard_kw: dict, dtype=F64) -> nn.Module:
    """One optimizer-less step of ``n_mb`` microbatches; ``order``: ``"BW"`` (W after each B) or ``"BBW"``.

    Gradient sync is off for all but the last microbatch's backward.
    """
    model = shard_model(build(delay, dtype=dtype), **shard_kw)
    if delay:
        defer_fsdp_reduction(model)
    for mb in range(n_mb):
        model.set_requires_gradient_sync(mb == n_mb - 1)
        loss_of(model(data(rank, mb, dtype))).backward()
        if delay and order == "BW":
            splitgrad.backward_dw(model)
    if delay:
        splitgrad.backward_dw(model)
    model.set_requires_gradient_sync(True)
    return model


def check_exact_one_microbatch(rank: int, world: int) -> None:
    """Delayed == immediate bitwise (sharded); full_tensor() == float64 reference."""
    ref = reference(world, 1)
    imm = sharded_grads(run_steps(rank, False, n_mb=1, order="BW", shard_kw={}))
    dly_model = run_steps(rank, True, n_mb=1, order="BW", shard_kw={})
    dly = sharded_grads(dly_model)
    assert_grads(dly, imm, "delayed vs immediate", bitwise=True)
    assert_grads(full(dly), ref, "delayed vs float64 reference", bitwise=False)
    if splitgrad.pending_wgrad(dly_model) != 0:
        raise AssertionError("work left over")


def check_wrong_answer_rejected(rank: int, world: int) -> None:
    """Negative check: a reference from other data, or one rank's unreduced gradient, is rejected."""
    dly = full(sharded_grads(run_steps(rank, True, n_mb=1, order="BW", shard_kw={})))
    wrong = reference(world + 1, 1)
    try:
        assert_grads(dly, wrong, "wrong reference", bitwise=False)
    except AssertionError:
        pass
    else:
        raise AssertionError("a reference with an extra rank's data was accepted")
    model = build(False)
    loss_of(model(data(rank, 0))).backward()  # this rank alone: what an unreduced gradient would be
    try:
        assert_grads(dly, sharded_grads(model), "unreduced", bitwise=False)
    except AssertionError:
        pass
    else:
        raise AssertionError("one rank's unreduced gradient was accepted")


def check_accumulation_and_reshard(rank: int, world: int) -> None:
    """3 microbatches, sync only on the last; W after each B or all at the end; reshard_after_forward both ways."""
    ref = reference(world, 3)
    for reshard in (True, False):
        kw = {"reshard_after_forward": reshard}
        imm = sharded_grads(run_steps(rank, False, n_mb=3, order="BW", shard_kw=kw))
        for order in ("BW", "BBW"):
            what = f"{reshard=} {order=}"
            dly = sharded_grads(run_steps(rank, True, n_mb=3, order=order, shard_kw=kw))
            assert_grads(dly, imm, f"{what}: delayed vs immediate", bitwise=True)
            assert_grads(full(dly), ref, f"{what}: vs reference", bitwise=False)


def check_no_reduce_until_last(rank: int, world: int) -> None:
    """With sync off, W writes nothing into the sharded .grad: held until the last microbatch's W."""
    model = shard_model(build(True))
    handle = defer_fsdp_reduction(model)
    _check_lookup(model, handle)
    model.set_requires_gradient_sync(False)
    loss_of(model(data(rank, 0))).backward()
    splitgrad.backward_dw(model)
    deferred = [model[1].weight, model[3].weight, model[4].weight]
    if any(p.grad is not None for p in deferred) or handle.held_gradients == 0:
        raise AssertionError(f"reduced before the last microbatch: {handle.held_gradients=}")
    try:
        handle.remove()
    except RuntimeError as exc:
        if "hold deferred gradients" not in str(exc):
            raise
    else:
        raise AssertionError("remove() with held gradients was accepted")
    model.set_requires_gradient_sync(True)
    loss_of(model(data(rank, 1))).backward()
    if any(p.grad is not None for p in deferred):
        raise AssertionError("a deferred gradient was reduced before its W ran")
    splitgrad.backward_dw(model)
    if handle.held_gradients != 0 or any(p.grad is None for p in deferred):
        raise AssertionError(f"not reduced at the last W: {handle.held_gradients=}")
    assert_grads(full(sharded_grads(model)), reference(world, 2), "held then reduced", bitwise=False)
    handle.remove()
    if any(fsdp_reduction_handle(model[i]) is not None for i in (1, 3, 4)):
        raise AssertionError("fsdp_reduction_handle still finds a removed handle")


def _check_lookup(model: nn.Sequential, handle) -> None:
    """``fsdp_reduction_handle``: the handle for every split layer it set up, None for everything else."""
    found = [fsdp_reduction_handle(model[i]) for i in (1, 3, 4)]
    if any(h is not handle for h in found):
        raise AssertionError(f"fsdp_reduction_handle of the split layers: {found}, expected {handle}")
    # Not trivially passing: a plain torch module, the FSDP2 root, and a split layer that no FSDP2 group
    # shards (so defer_fsdp_reduction never set it up) have none.
    others = {"LayerNorm": model[0], "root": model, "unsharded Linear": build(True)[1]}
    wrong = {name: h for name, m in others.items() if (h := fsdp_reduction_handle(m)) is not None}
    if wrong:
        raise AssertionError(f"fsdp_reduction_handle found handles where none was set up: {wrong}")


def check_mixed_precision(rank: int, world: int) -> None:
    """param_dtype float32 / reduce_dtype float64 on a float64 model: delayed == immediate bitwise."""
    kw = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=F64)}
    ref = reference(world, 2)
    for order in ("BW", "BBW"):
        imm = sharded_grads(run_steps(rank, False, n_mb=2, order="BW", shard_kw=kw))
        dly = sharded_grads(run_steps(rank, True, n_mb=2, order=order, shard_kw=kw))
        assert_grads(dly, imm, f"mixed precision {order}: delayed vs immediate", bitwise=True)
        assert_grads(full(dly), ref, f"mixed precision {order}: vs reference", bitwise=False, rtol=1e-5)


def check_errors(rank: int, world: int) -> None:
    """Without the call: a clear error naming defer_fsdp_reduction; fused main_grad and no FSDP: ValueError."""
    model = shard_model(build(True))
    loss_of(model(data(rank, 0))).backward()
    try:
        splitgrad.backward_dw(model)
    except RuntimeError as exc:
        if "defer_fsdp_reduction" not in str(exc) or "DTensor" not in str(exc):
            raise
    else:
        raise AssertionError("a delayed layer under FSDP2 without defer_fsdp_reduction was accepted")
    splitgrad.discard_wgrad(model)
    fused = nn.Sequential(splitgrad.Linear(D, D, delay_wgrad_compute=True, fuse_wgrad_accumulation=True))
    fully_shard(fused)
    expect_error(ValueError, "fuse_wgrad_accumulation", lambda: defer_fsdp_reduction(fused))
    expect_error(ValueError, "no fully_shard", lambda: defer_fsdp_reduction(build(True)))
    twice = shard_model(build(True))
    defer_fsdp_reduction(twice)
    expect_error(ValueError, "already set up", lambda: defer_fsdp_reduction(twice))
    expect_error(ValueError, "mode=", lambda: defer_fsdp_reduction(shard_model(build(True)), mode="later"))
    expect_error(ValueError, "reduction=", lambda: FSDPStage(shard_model(build(True)), reduction="later"))


def check_finish_and_async_modes(rank: int, world: int) -> None:
    """mode="finish": held after the last W until finish(); "async": started at the last W, in flight until
    finish() or the next forward; sharded grads bitwise equal to immediate mode, one timed event per group."""
    imm = sharded_grads(run_steps(rank, False, n_mb=2, order="BW", shard_kw={}))
    ref = reference(world, 2)
    for mode in ("finish", "async"):
        for order in ("BW", "BBW"):
            what = f"{mode=} {order=}"
            model = shard_model(build(True))
            handle = defer_fsdp_reduction(model, mode=mode, timeout=120)
            for mb in range(2):
                model.set_requires_gradient_sync(mb == 1)
                loss_of(model(data(rank, mb))).backward()
                if order == "BW":
                    splitgrad.backward_dw(model)
            splitgrad.backward_dw(model)
            deferred = [model[1].weight, model[3].weight, model[4].weight]
            if mode == "finish" and (handle.held_gradients != 6 or any(p.grad is not None for p in deferred)):
                raise AssertionError(f"{what}: reduced before finish(): {handle.held_gradients=}")
            if mode == "async" and (handle.in_flight != 3 or handle.held_gradients):
                raise AssertionError(
                    f"{what}: {handle.in_flight=} (want one per group) {handle.held_gradients=}"
                )
            if mode == "async" and order == "BBW":
                model(data(rank, 0))  # the next forward joins the background reductions first
                model.reshard()  # FSDP2 leaves the root unsharded after forward; read the sharded .grad
            else:
                handle.finish()
            if handle.held_gradients or handle.in_flight:
                raise AssertionError(f"{what}: left {handle.held_gradients=} {handle.in_flight=}")
            assert_grads(sharded_grads(model), imm, f"{what}: vs immediate", bitwise=True)
            assert_grads(full(sharded_grads(model)), ref, f"{what}: vs reference", bitwise=False)
            events = handle.pop_comm_events()
            if len(events) != 3 or any(
                not (label.startswith("reduce-scatter") and s <= e) for label, s, e in events
            ):
                raise AssertionError(f"{what}: reduce-scatter events {events}")
            handle.remove()


def meta_model(delay: bool) -> nn.Sequential:
    """FSDP2's deferred initialisation: build on meta, shard, materialise, initialise the shards."""
    with torch.device("meta"):
        model = build(delay)
    shard_model(model)
    model.to_empty(device="cpu")
    torch.manual_seed(7)
    for module in model.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    return model


def check_meta_device_init(rank: int, world: int) -> None:
    """Meta construction then to_empty + reset_parameters: initialised shards, delayed == immediate bitwise."""
    models = {delay: meta_model(delay) for delay in (False, True)}
    for name, p in models[True].named_parameters():
        full_p = p.full_tensor()
        if not torch.isfinite(full_p).all() or (name.endswith("weight") and full_p.abs().sum() == 0):
            raise AssertionError(f"{name} not initialised")
    defer_fsdp_reduction(models[True])
    for delay, model in models.items():
        loss_of(model(data(rank, 0))).backward()
        if delay:
            splitgrad.backward_dw(model)
    assert_grads(sharded_grads(models[True]), sharded_grads(models[False]), "meta init", bitwise=True)


def tiny(delay: bool) -> nn.Sequential:
    """Two split layers around a GELU, each its own ``fully_shard`` unit (compile on CPU is slow: keep it tiny)."""
    torch.manual_seed(3)
    return nn.Sequential(
        splitgrad.Linear(D, 2 * D, delay_wgrad_compute=delay, params_dtype=F64),
        nn.GELU(),
        splitgrad.Linear(2 * D, D, delay_wgrad_compute=delay, params_dtype=F64),
    )


def compile_step(rank: int, delay: bool, compiled: bool) -> dict[str, torch.Tensor]:
    """One sharded step of :func:`tiny`, eager or ``torch.compile`` (default); the sharded ``.grad``."""
    model = tiny(delay)
    for unit in (model[0], model[2], model):
        fully_shard(unit)
    if delay:
        defer_fsdp_reduction(model)
    run = torch.compile(model) if compiled else model
    loss_of(run(data(rank, 0))).backward()
    if delay:
        if splitgrad.pending_wgrad(model) != 2:
            raise AssertionError(f"{splitgrad.pending_wgrad(model)=} parked, expected 2")
        splitgrad.backward_dw(model)
    return sharded_grads(model)


def graph_breaks(model: nn.Module) -> tuple[int, list[str]]:
    """``(graph count, break reasons)`` of ``model`` on one input (``torch._dynamo.explain``)."""
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(data(0, 0))
    splitgrad.discard_wgrad(model)
    return explained.graph_count, [str(r.reason) for r in explained.break_reasons]


def check_compile(rank: int, world: int) -> None:
    """torch.compile x FSDP2, immediate and delayed: compiled == eager sharded grads, == float64 reference.

    Graph breaks against compile alone (docs/fsdp_compile.md): delayed is the same (each split layer runs
    outside the graph, with splitgrad's reason); immediate gets one graph per ``fully_shard`` unit instead of
    one in all (dynamo traces each FSDP2 module's forward as its own frame; no break reason is reported).
    """
    model = tiny(False)
    for r in range(world):
        (loss_of(model(data(r, 0))) / world).backward()
    want = {n: p.grad for n, p in model.named_parameters()}
    for delay in (False, True):
        torch._dynamo.reset()
        eager = compile_step(rank, delay, compiled=False)
        compiled = compile_step(rank, delay, compiled=True)
        assert_grads(compiled, eager, f"{delay=}: compiled vs eager", bitwise=False)
        assert_grads(full(compiled), want, f"{delay=}: compiled vs float64 reference", bitwise=False)
        sharded = tiny(delay)
        for unit in (sharded[0], sharded[2], sharded):
            fully_shard(unit)
        if delay:
            defer_fsdp_reduction(sharded)
        alone, under_fsdp = graph_breaks(tiny(delay)), graph_breaks(sharded)
        if delay:
            if under_fsdp != alone or len(alone[1]) != 1 or "splitgrad:" not in alone[1][0]:
                raise AssertionError(f"delayed: breaks under FSDP2 {under_fsdp} vs compile alone {alone}")
        elif alone != (1, []) or under_fsdp != (2, []):
            raise AssertionError(
                f"immediate: graphs/breaks under FSDP2 {under_fsdp} vs compile alone {alone}"
            )
    # Not trivially passing: one rank's unreduced gradient is not the reference.
    try:
        assert_grads(full(compiled), sharded_grads(_local(rank)), "unreduced", bitwise=False)
    except AssertionError:
        pass
    else:
        raise AssertionError("one rank's unreduced gradient was accepted")


def _local(rank: int) -> nn.Module:
    model = tiny(False)
    loss_of(model(data(rank, 0))).backward()
    return model


CHECKS = [
    check_meta_device_init,
    check_exact_one_microbatch,
    check_wrong_answer_rejected,
    check_accumulation_and_reshard,
    check_no_reduce_until_last,
    check_mixed_precision,
    check_finish_and_async_modes,
    check_errors,
    check_compile,
]
