"""Build a :class:`~tests.conformance.cases.Case` in a mode, drive microbatches through it, and compare runs.

Everything here goes through the public contract only, so the checks mean the same for a module, an op, a
``Sequential`` of ops or a graphed callable (whose ``backward_dw`` replays a wgrad graph).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

import splitgrad
from splitgrad.testing import CpuGraphBackend
from tests.helpers import attach_main_grad, grads

from .cases import Case

F64 = {"rtol": 1e-10, "atol": 1e-12}
EXACT = {"rtol": 0.0, "atol": 0.0}


def delays(mode: str) -> bool:
    return mode in ("delayed", "fused_delayed")


def fuses(mode: str) -> bool:
    return mode in ("fused", "fused_delayed")


@dataclass
class Built:
    """A case built in one mode: ``module`` owns the parameters, ``subject`` is what is called and drained
    (the module itself, or its graphed callable)."""

    case: Case
    mode: str
    dtype: torch.dtype
    module: nn.Module
    subject: object
    main_grad_start: dict[str, torch.Tensor] = field(default_factory=dict)

    def members(self) -> list[tuple[str, nn.Module]]:
        """The split-capable submodules (each owns one task per backward and its own wgrad hooks)."""
        return list(splitgrad.split_modules(self.module))

    def dw_params(self) -> list[nn.Parameter]:
        """What the members say ``backward_dw`` writes (frozen parameters left out)."""
        return [p for _, m in self.members() for p in m.get_backward_dw_params()]


def build(case: Case, mode: str, dtype: torch.dtype, *, frozen: Sequence[str] = (), seed: int = 0) -> Built:
    """The case in ``mode`` with every parameter drawn at random (seeded: two builds are identical).

    Frozen parameters are frozen before ``main_grad`` buffers are attached (a wrapper gives none to frozen
    weights) and before graph capture.
    """
    if mode not in case.modes:
        raise ValueError(f"{case.name} does not support {mode=} (supports {case.modes})")
    module = case.make(delays(mode), fuses(mode), dtype)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) * 0.5)
    for name in frozen:
        module.get_parameter(name).requires_grad_(False)
    start = {}
    if fuses(mode):
        names = {id(p): n for n, p in module.named_parameters()}
        for p in attach_main_grad(module, seed=seed + 1):
            p.grad_added_to_main_grad = False
            start[names[id(p)]] = p.main_grad.clone()
    subject: object = module
    if case.graphed:
        sample = torch.zeros(case.x_shape, dtype=dtype, requires_grad=True)
        subject = splitgrad.make_graphed_callables(module, (sample,), backend=CpuGraphBackend())
    return Built(case, mode, dtype, module, subject, start)


def inputs(built: Built, step: int, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, tuple]:
    """Microbatch ``step``'s input and output gradients (seeded; shapes from a dry eager forward)."""
    dtype = built.dtype if dtype is None else dtype
    gen = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(built.case.x_shape, generator=gen, dtype=torch.float64).to(dtype)
    with torch.no_grad():
        shapes = [o.shape for o in built.case.call(built.module, x.to(built.dtype))]
    dys = tuple(torch.randn(s, generator=gen, dtype=torch.float64).to(dtype) for s in shapes)
    return x, dys


@dataclass
class Result:
    """Outputs of the last microbatch, input gradient per microbatch, and every parameter's gradient."""

    outputs: tuple[torch.Tensor, ...]
    dxs: list[torch.Tensor]
    grads: dict[str, torch.Tensor | None]


def backward(built: Built, step: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """Forward and backward of microbatch ``step`` (no ``backward_dw``); returns (outputs, dx), detached."""
    x, dys = inputs(built, step)
    x.requires_grad_()
    outs = built.case.call(built.subject, x)
    torch.autograd.backward(outs, dys)
    # Clone: a graphed callable's outputs are static buffers rewritten by its next call.
    return tuple(o.detach().clone() for o in outs), x.grad.detach().clone()


def run(
    case: Case,
    mode: str,
    dtype: torch.dtype,
    *,
    steps: int = 2,
    built: Built | None = None,
    drain_at_end: bool = False,
) -> Result:
    """``steps`` microbatches, each followed by one ``backward_dw()`` when delaying (or all of them after the
    last backward with ``drain_at_end``: each call runs the oldest pending work); nothing may stay owed."""
    built = build(case, mode, dtype) if built is None else built
    dxs = []
    outs: tuple[torch.Tensor, ...] = ()
    for step in range(steps):
        outs, dx = backward(built, step)
        dxs.append(dx)
        if delays(mode) and not drain_at_end:
            built.subject.backward_dw()
    if delays(mode) and drain_at_end:
        for _ in range(steps):
            built.subject.backward_dw()
    splitgrad.ensure_no_pending_wgrad(built.module, what=f"the end of {case.name} {mode}")
    return Result(outs, dxs, grads(built.module))


def reference(built: Built, *, steps: int = 2) -> Result:
    """Plain float64 autograd over ``case.reference`` on copies of ``built``'s parameters (same inputs).

    In fused modes the expected buffer content is the starting ``main_grad`` plus the gradient.
    """
    params = {
        n: p.detach().to(torch.float64).clone().requires_grad_(p.requires_grad)
        for n, p in built.module.named_parameters()
    }
    dxs = []
    outs: tuple[torch.Tensor, ...] = ()
    for step in range(steps):
        x, dys = inputs(built, step, torch.float64)
        x.requires_grad_()
        outs = built.case.reference(params, x)
        torch.autograd.backward(outs, dys)
        dxs.append(x.grad)
    want = {n: p.grad for n, p in params.items()}
    for name, start in built.main_grad_start.items():
        want[name] = want[name] + start.to(torch.float64)
    return Result(tuple(o.detach() for o in outs), dxs, want)


def assert_results(got: Result, want: Result, tol: dict, what: str) -> None:
    """Outputs, input gradients and every named gradient equal within ``tol``; None must match None."""
    assert len(got.outputs) == len(want.outputs), f"{what}: {len(got.outputs)} outputs vs {len(want.outputs)}"
    for i, (a, b) in enumerate(zip(got.outputs, want.outputs)):
        torch.testing.assert_close(a.to(b.dtype), b, **tol, msg=lambda m, i=i: f"{what}: output {i}: {m}")
    for i, (a, b) in enumerate(zip(got.dxs, want.dxs, strict=True)):
        torch.testing.assert_close(a.to(b.dtype), b, **tol, msg=lambda m, i=i: f"{what}: dx of step {i}: {m}")
    assert_grads(got.grads, want.grads, tol, what)


def assert_grads(got: dict, want: dict, tol: dict, what: str) -> None:
    """Same names, same Nones, values within ``tol`` (``EXACT`` for bitwise)."""
    assert got.keys() == want.keys(), f"{what}: names differ: {sorted(set(got) ^ set(want))}"
    for name in want:
        a, b = got[name], want[name]
        if a is None or b is None:
            assert a is None and b is None, f"{what}: {name}: got {a} want {b}"
            continue
        torch.testing.assert_close(a.to(b.dtype), b, **tol, msg=lambda m, n=name: f"{what}: {n}: {m}")
