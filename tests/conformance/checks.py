"""The split contract, one check per clause, runnable on any :class:`~tests.conformance.cases.Case`.

Each ``check_*`` raises ``AssertionError`` (or lets a library error through) when the case breaks the
contract; ``tests/conformance/test_checker.py`` proves each one rejects a deliberately broken case.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch

import splitgrad
from tests.helpers import grads

from .cases import Case
from .driver import (
    EXACT,
    F64,
    Built,
    assert_grads,
    assert_results,
    backward,
    build,
    delays,
    fuses,
    reference,
    run,
)

N_BUNDLES = 3


def _read(p: torch.nn.Parameter) -> torch.Tensor | None:
    """Where the parameter's gradient lives: ``main_grad`` when it has one, else ``.grad`` (cloned)."""
    g = getattr(p, "main_grad", None)
    g = p.grad if g is None else g
    return None if g is None else g.detach().clone()


def _state(built: Built) -> dict[int, torch.Tensor | None]:
    return {id(p): _read(p) for p in built.module.parameters()}


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


def check_float64_reference(case: Case, mode: str) -> None:
    """Outputs, input gradients and every parameter gradient of two microbatches equal plain float64 autograd.

    Fused modes: the weights' gradients land in the same ``main_grad`` tensors (added to their contents), their
    ``.grad`` stays None and ``grad_added_to_main_grad`` is set.
    """
    built = build(case, mode, torch.float64)
    buffers = {id(p): p.main_grad for p in built.module.parameters() if hasattr(p, "main_grad")}
    got = run(case, mode, torch.float64, built=built)
    assert_results(got, reference(built), F64, f"{case.name} {mode} vs float64 autograd")
    for name, p in built.module.named_parameters():
        if id(p) in buffers:
            assert p.main_grad is buffers[id(p)], f"{case.name} {mode}: {name}.main_grad was replaced"
            assert p.grad is None, f"{case.name} {mode}: {name} got .grad beside main_grad"
            assert p.grad_added_to_main_grad is True, f"{case.name} {mode}: {name}.grad_added_to_main_grad"


def check_bitwise_vs_immediate(case: Case, dtype: torch.dtype) -> None:
    """Deferring changes when the wgrad is computed, never its bits: delayed == immediate and
    fused+delayed == fused, outputs and every gradient, over two microbatches."""
    for deferred, now in (("delayed", "immediate"), ("fused_delayed", "fused")):
        if deferred in case.modes and now in case.modes:
            assert_results(
                run(case, deferred, dtype),
                run(case, now, dtype),
                EXACT,
                f"{case.name} {deferred} vs {now} {dtype}",
            )


def check_fifo_drain(case: Case, dtype: torch.dtype) -> None:
    """Two backwards, then two ``backward_dw()`` calls (oldest first) give immediate mode's bits."""
    for deferred, now in (("delayed", "immediate"), ("fused_delayed", "fused")):
        if deferred in case.modes and now in case.modes:
            got = run(case, deferred, dtype, drain_at_end=True)
            assert_results(
                got, run(case, now, dtype), EXACT, f"{case.name} {deferred} drained at end vs {now}"
            )


def check_owed_work_is_visible(case: Case, mode: str) -> None:
    """Between backward and ``backward_dw`` the work is owed: the optimizer guard refuses to step,
    ``ensure_no_pending_wgrad`` raises, and the module refuses to be deep-copied; afterwards all three pass."""
    built = build(case, mode, torch.float64)
    opt = torch.optim.SGD([p for p in built.module.parameters() if p.requires_grad], lr=0.0)
    splitgrad.guard_optimizer(opt, built.module)
    backward(built, 0)
    with pytest.raises(RuntimeError, match="pending"):
        opt.step()
    with pytest.raises(RuntimeError, match="pending"):
        splitgrad.ensure_no_pending_wgrad(built.module)
    with pytest.raises(RuntimeError, match="pending"):
        copy.deepcopy(built.module)
    built.subject.backward_dw()
    opt.step()  # lr=0: the step itself changes nothing
    splitgrad.ensure_no_pending_wgrad(built.module)
    copy.deepcopy(built.module)


def check_hooks(case: Case, mode: str) -> None:
    """Each split-capable member's wgrad hook fires exactly once per task, after its gradients are written
    (the hook reads them); never in immediate mode; the returned handles remove the hooks."""
    built = build(case, mode, torch.float64)
    members = built.members()
    assert members, f"{case.name}: no split-capable submodule"
    seen: dict[str, list[list[torch.Tensor | None]]] = {name: [] for name, _ in members}
    handles = []
    for name, m in members:
        params = m.get_backward_dw_params()

        def hook(name: str = name, params: list = params) -> None:
            seen[name].append([_read(p) for p in params])

        handles.append(m.register_wgrad_accumulation_and_reduce_hooks(hook))
    outer: list[int] = []
    if hasattr(built.subject, "register_wgrad_accumulation_and_reduce_hooks"):
        handles.append(built.subject.register_wgrad_accumulation_and_reduce_hooks(lambda: outer.append(1)))

    before = _state(built)
    backward(built, 0)
    if delays(mode):
        assert all(not v for v in seen.values()) and not outer, (
            f"{case.name} {mode}: a hook fired in backward"
        )
        after = _state(built)
        written = [k for k in built.dw_params() if not _same(before[id(k)], after[id(k)])]
        assert not written, f"{case.name} {mode}: backward wrote {len(written)} deferred gradient(s)"
        with pytest.raises(RuntimeError, match="pending"):
            splitgrad.ensure_no_pending_wgrad(built.module)
        built.subject.backward_dw()
    fires = 0 if mode == "immediate" else 1
    for name, m in members:
        assert len(seen[name]) == fires, (
            f"{case.name} {mode}: {name}'s hook fired {len(seen[name])}x, want {fires}"
        )
        for p, snapshot in zip(m.get_backward_dw_params(), seen[name][0] if fires else ()):
            final = _read(p)
            assert snapshot is not None and _same(snapshot, final), (
                f"{case.name} {mode}: {name}'s hook fired before its gradient (shape {tuple(p.shape)}) was written"
            )
    if hasattr(built.subject, "register_wgrad_accumulation_and_reduce_hooks"):
        assert len(outer) == fires * len(members), f"{case.name} {mode}: outer hook fired {len(outer)}x"
    for handle in handles:
        handle.remove()
    counts = [len(v) for v in seen.values()] + [len(outer)]
    backward(built, 1)
    if delays(mode):
        built.subject.backward_dw()
    after_removal = [len(v) for v in seen.values()] + [len(outer)]
    assert after_removal == counts, (
        f"{case.name} {mode}: removed hooks fired again: {counts} -> {after_removal}"
    )


def check_backward_dw_params(case: Case, mode: str) -> None:
    """``get_backward_dw_params()`` lists exactly the parameters ``backward_dw`` writes."""
    built = build(case, mode, torch.float64)
    listed = {id(p) for p in built.subject.get_backward_dw_params()}
    assert listed == {id(p) for p in built.dw_params()}, f"{case.name}: subject and members disagree"
    backward(built, 0)
    before = _state(built)
    built.subject.backward_dw()
    after = _state(built)
    names = {id(p): n for n, p in built.module.named_parameters()}
    changed = {k for k in after if not _same(before[k], after[k])}
    assert changed == listed, (
        f"{case.name} {mode}: backward_dw wrote {sorted(names[k] for k in changed)}, "
        f"get_backward_dw_params() lists {sorted(names[k] for k in listed)}"
    )


def check_skip_backward_post_hook(case: Case, mode: str) -> None:
    """``skip_backward_post_hook`` is True exactly on the trainable parameters the module writes itself
    (delayed or fused), False/absent on those autograd writes; ``set_delay_wgrad_compute`` keeps it so;
    ``need_backward_dw()`` says whether it defers."""
    built = build(case, mode, torch.float64)

    def assert_flags(writes_itself: bool, what: str) -> None:
        own = {id(p) for p in built.dw_params()}
        for name, p in built.module.named_parameters():
            if p.requires_grad:
                want = writes_itself and id(p) in own
                got = getattr(p, "skip_backward_post_hook", False)
                assert got == want, f"{case.name} {what}: {name}.skip_backward_post_hook={got}, want {want}"

    assert_flags(mode != "immediate", mode)
    need = built.subject.need_backward_dw()
    assert need == delays(mode), f"{case.name} {mode}: need_backward_dw()={need}"
    if case.graphed or fuses(mode):
        return  # a graph keeps its captured split; fused writes itself whatever the delay switch says
    splitgrad.set_delay_wgrad_compute(built.module, not delays(mode))
    assert_flags(not delays(mode), f"{mode} switched to delay={not delays(mode)}")
    assert built.subject.need_backward_dw() == (not delays(mode)), f"{case.name}: switch ignored"


def check_frozen(case: Case, mode: str) -> None:
    """Frozen parameters get no gradient (nor a main_grad write), are left out of ``get_backward_dw_params()``,
    and the trainable ones still equal plain float64 autograd."""
    built = build(case, mode, torch.float64, frozen=case.frozen)
    frozen = {id(built.module.get_parameter(n)) for n in case.frozen}
    listed = {id(p) for p in built.subject.get_backward_dw_params()}
    assert not frozen & listed, f"{case.name} {mode}: get_backward_dw_params() lists a frozen parameter"
    got = run(case, mode, torch.float64, built=built)
    for name in case.frozen:
        assert got.grads[name] is None, f"{case.name} {mode}: frozen {name} got a gradient"
    assert_results(got, reference(built), F64, f"{case.name} {mode} frozen {case.frozen}")


def _bundled(case: Case, mode: str, order: list[int]) -> dict[str, torch.Tensor | None]:
    """``N_BUNDLES`` microbatches, each backward captured in its own bundle, the bundles run in ``order``."""
    built = build(case, mode, torch.float64)
    fired = {name: 0 for name, _ in built.members()}
    for name, m in built.members():
        m.register_wgrad_accumulation_and_reduce_hooks(
            lambda name=name: fired.__setitem__(name, fired[name] + 1)
        )
    bundles = []
    for step in range(N_BUNDLES):
        with splitgrad.capture_wgrad() as bundle:
            backward(built, step)
        assert len(bundle) == len(built.members()), (
            f"{case.name}: {len(bundle)} tasks in one backward's bundle"
        )
        bundles.append(bundle)
    assert not any(fired.values()), f"{case.name} {mode}: a hook fired before its bundle ran: {fired}"
    for i in order:
        bundles[i].run()
    assert all(n == N_BUNDLES for n in fired.values()), f"{case.name} {mode}: hooks per member {fired}"
    with pytest.raises(RuntimeError, match="already ran"):
        bundles[order[0]].run()
    splitgrad.ensure_no_pending_wgrad(built.module, what=f"after running the bundles of {case.name}")
    return grads(built.module)


def bitwise_order_independent(order: list[int], mode: str) -> bool:
    """Whether running bundles in ``order`` must give FIFO's bits.

    Each bundle adds its microbatch's gradient into the accumulator: ``.grad`` starts as the first gradient
    written, so the first two commute (``a + b == b + a`` in IEEE arithmetic) but a third does not associate
    (``(a + b) + c != (a + c) + b``). ``main_grad`` starts non-zero, so no reordering is exact there.
    """
    return not fuses(mode) and all(i == pos for pos, i in enumerate(order) if pos >= 2)


def check_bundles_any_order(case: Case, mode: str, seed: int = 0) -> None:
    """Microbatches captured in ``capture_wgrad`` bundles: FIFO equals immediate mode bitwise, a random
    permutation equals FIFO (bitwise where the accumulation order allows it, float64-close otherwise), and the
    result equals plain float64 autograd."""
    fifo = list(range(N_BUNDLES))
    got_fifo = _bundled(case, mode, fifo)
    want = reference(build(case, mode, torch.float64), steps=N_BUNDLES)
    # The first-two swap is bitwise-equal by the rule below; the reversal and the random order usually are not.
    orders = ([1, 0, *fifo[2:]], fifo[::-1], random.Random(f"{case.name}{seed}").sample(fifo, N_BUNDLES))
    for order in orders:
        exact = bitwise_order_independent(order, mode)
        got = _bundled(case, mode, order)
        what = f"{case.name} {mode} bundles run {order}"
        assert_grads(got, got_fifo, EXACT if exact else F64, f"{what} vs FIFO")
        assert_grads(got, want.grads, F64, f"{what} vs float64 autograd")
    now = "fused" if fuses(mode) else "immediate"
    immediate = run(case, now, torch.float64, steps=N_BUNDLES)
    assert_grads(got_fifo, immediate.grads, EXACT, f"{case.name} {mode} FIFO bundles vs {now}")


def check_idle_backward_dw_raises(case: Case, mode: str) -> None:
    """``backward_dw()`` with nothing pending raises ``RuntimeError`` naming the module: before any backward,
    and again once the pending work ran (it never silently does nothing)."""
    built = build(case, mode, torch.float64)
    owner = type(built.module).__name__
    with pytest.raises(RuntimeError, match=owner):
        built.subject.backward_dw()
    if delays(mode):
        backward(built, 0)
        built.subject.backward_dw()
        with pytest.raises(RuntimeError, match=owner):
            built.subject.backward_dw()
