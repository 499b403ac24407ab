"""Drive any splitgrad module through every split mode and compare it with a plain-torch reference.

A :class:`Case` describes one module configuration: how to build it, how to call it, and a plain-torch
reference written from the parameters by name. The ``check_*`` functions cover what varies with a module's
options (norms, activations, shapes, frozen subsets, main_grad flags); each module's test file runs them on its
own cases. The clauses every split-capable class shares (hooks, ``skip_backward_post_hook``,
``get_backward_dw_params``, bundles in any order, idle ``backward_dw``) are checked once for all classes in
``tests/conformance``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from torch import nn

import splitgrad
from tests.helpers import attach_main_grad, fused_weights, grads

MODES = ("immediate", "delayed", "fused", "fused_delayed")
F64 = {"rtol": 1e-10, "atol": 1e-12}
EXACT = {"rtol": 0, "atol": 0}


@dataclass(kw_only=True)
class Case:
    """One module configuration under test."""

    name: str
    make: Callable[..., nn.Module]
    """``make(delay_wgrad_compute=, fuse_wgrad_accumulation=, params_dtype=)`` -> module."""
    x_shape: tuple[int, ...]
    call: Callable[[nn.Module, torch.Tensor], tuple[torch.Tensor, ...]]
    """Runs the module; always returns a tuple of outputs."""
    reference: Callable[[dict[str, torch.Tensor], torch.Tensor], tuple[torch.Tensor, ...]]
    """Plain torch from ``{param_name: tensor}`` and the input."""

    def __repr__(self) -> str:
        return self.name


def mode_kwargs(mode: str) -> dict[str, bool]:
    return {
        "delay_wgrad_compute": mode in ("delayed", "fused_delayed"),
        "fuse_wgrad_accumulation": mode in ("fused", "fused_delayed"),
    }


def build(case: Case, mode: str, dtype: torch.dtype, *, seed: int = 0) -> nn.Module:
    """The module with every parameter random (seeded), so norms are not the identity and biases not zero."""
    module = case.make(**mode_kwargs(mode), params_dtype=dtype)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) * 0.5)
    return module


def inputs(case: Case, dtype: torch.dtype, module: nn.Module, step: int) -> tuple[torch.Tensor, tuple]:
    """Input and output gradients of step ``step`` (seeded, shapes read from a dry forward)."""
    gen = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(case.x_shape, generator=gen, dtype=torch.float64).to(dtype)
    with torch.no_grad():
        outs = case.call(module, x)
    dys = tuple(torch.randn(o.shape, generator=gen, dtype=torch.float64).to(dtype) for o in outs)
    return x, dys


def run(case: Case, mode: str, dtype: torch.dtype, *, steps: int = 1, module: nn.Module | None = None):
    """Forward+backward ``steps`` times (``backward_dw`` after each when delaying).

    Returns:
        ``(outputs of the last step, [x.grad per step], grads(module))``.
    """
    module = build(case, mode, dtype) if module is None else module
    if mode.startswith("fused") and not any(hasattr(p, "main_grad") for p in fused_weights(module)):
        attach_main_grad(module, seed=1)
    dxs = []
    for step in range(steps):
        x, dys = inputs(case, dtype, module, step)
        x.requires_grad_()
        outs = case.call(module, x)
        torch.autograd.backward(outs, dys)
        dxs.append(x.grad)
        if module.need_backward_dw() and module.get_backward_dw_params():
            assert splitgrad.pending_wgrad(module) == 1
            module.backward_dw()
        assert splitgrad.pending_wgrad(module) == 0
    return tuple(o.detach() for o in outs), dxs, grads(module)


def reference(case: Case, dtype: torch.dtype, *, steps: int = 1, module: nn.Module | None = None):
    """Plain autograd on clones of the module's parameters (same init); same return as :func:`run`."""
    module = build(case, "immediate", dtype) if module is None else module
    params = {n: p.detach().clone().requires_grad_(p.requires_grad) for n, p in module.named_parameters()}
    dxs = []
    for step in range(steps):
        x, dys = inputs(case, dtype, module, step)
        x.requires_grad_()
        outs = case.reference(params, x)
        torch.autograd.backward(outs, dys)
        dxs.append(x.grad)
    return tuple(o.detach() for o in outs), dxs, {n: p.grad for n, p in params.items()}


def assert_all_close(got, want, tol: dict) -> None:
    """``got``/``want`` as returned by :func:`run`; grads compared by name, Nones must match."""
    (outs, dxs, gs), (routs, rdxs, rgs) = got, want
    assert len(outs) == len(routs)
    for a, b in zip(outs, routs):
        torch.testing.assert_close(a, b, **tol)
    for a, b in zip(dxs, rdxs):
        torch.testing.assert_close(a, b, **tol)
    assert gs.keys() == rgs.keys()
    for name in gs:
        if gs[name] is None or rgs[name] is None:
            assert gs[name] is None and rgs[name] is None, f"{name}: got {gs[name]} want {rgs[name]}"
            continue
        torch.testing.assert_close(gs[name], rgs[name], **tol, msg=lambda m, n=name: f"{n}: {m}")


# -- the contract checks --------------------------------------------------------------------------------


def check_float64_reference(case: Case, mode: str) -> None:
    """Output, input gradient and every parameter gradient agree with plain autograd, over two steps."""
    got = run(case, mode, torch.float64, steps=2)
    ref_module = build(case, mode, torch.float64)
    want = reference(case, torch.float64, steps=2, module=ref_module)
    if mode.startswith("fused"):
        # main_grad started from a random buffer: the reference adds the same start.
        attach_main_grad(ref_module, seed=1)
        for name, p in ref_module.named_parameters():
            if hasattr(p, "main_grad"):
                want[2][name] = want[2][name] + p.main_grad
    assert_all_close(got, want, F64)


def check_delayed_bitwise(case: Case, dtype: torch.dtype = torch.float32) -> None:
    """Deferring changes when the wgrad is computed, never its bits (plain and fused pairs, two steps)."""
    assert_all_close(run(case, "delayed", dtype, steps=2), run(case, "immediate", dtype, steps=2), EXACT)
    assert_all_close(run(case, "fused_delayed", dtype, steps=2), run(case, "fused", dtype, steps=2), EXACT)


def check_mode_fixed_at_forward(case: Case) -> None:
    """Switching deferral between forward and backward cannot mix modes: the forward's setting wins."""
    module = build(case, "immediate", torch.float64)
    x, dys = inputs(case, torch.float64, module, 0)
    outs = case.call(module, x)
    module.set_delay_wgrad_compute(True)
    torch.autograd.backward(outs, dys)
    assert splitgrad.pending_wgrad(module) == 0
    assert all(p.grad is not None for p in module.parameters())
    torch.autograd.backward(case.call(module, x), dys)
    module.set_delay_wgrad_compute(False)
    assert splitgrad.backward_dw(module) == 1


def check_fused_main_grad(case: Case) -> None:
    """Fused: weights go to main_grad (``.grad`` stays None), overwrite_main_grad and grad_added_to_main_grad work."""
    for mode in ("fused", "fused_delayed"):
        module = build(case, mode, torch.float64)
        attach_main_grad(module, fill=7.0)
        first = fused_weights(module)[0]
        first.overwrite_main_grad = True
        for p in fused_weights(module):
            p.grad_added_to_main_grad = False
        fired = []
        module.register_wgrad_accumulation_and_reduce_hooks(lambda fired=fired: fired.append(1))
        x, dys = inputs(case, torch.float64, module, 0)
        torch.autograd.backward(case.call(module, x), dys)
        assert len(fired) == (0 if mode == "fused_delayed" else 1)
        splitgrad.backward_dw(module)
        assert len(fired) == 1
        ref = reference(case, torch.float64, module=build(case, "immediate", torch.float64))[2]
        name_of = {id(p): n for n, p in module.named_parameters()}
        for p in fused_weights(module):
            name = name_of[id(p)]
            assert p.grad is None and p.grad_added_to_main_grad, name
            start = 0.0 if p is first else 7.0
            torch.testing.assert_close(p.main_grad, ref[name] + start, **F64)
        for p in module.get_backward_dw_params():
            if p.dim() == 1:
                torch.testing.assert_close(p.grad, ref[name_of[id(p)]], **F64)


def check_missing_main_grad_is_an_error(case: Case) -> None:
    module = build(case, "fused", torch.float64)
    x, dys = inputs(case, torch.float64, module, 0)
    try:
        torch.autograd.backward(case.call(module, x), dys)
    except RuntimeError as err:
        assert "main_grad" in str(err) and type(module).__name__ in str(err), str(err)
    else:
        raise AssertionError("fused backward without main_grad did not raise")


def check_contract(case: Case) -> None:
    """The mode is fixed at forward, main_grad is written when fused, a missing main_grad is an error."""
    check_mode_fixed_at_forward(case)
    check_fused_main_grad(case)
    check_missing_main_grad_is_an_error(case)


def correctness_tests(cases: list[Case], *, bf16_case: Case) -> tuple[Callable[..., None], ...]:
    """The correctness tests every module file runs on its cases, for the file to bind to ``test_*`` names.

    Returns ``(test_float64_matches_plain_torch, test_delayed_is_bitwise_immediate,
    test_delayed_is_bitwise_immediate_bf16)``: every case in every mode against plain autograd in float64,
    every case deferred against immediate bitwise, and ``bf16_case`` the same in bfloat16. pytest collects
    them under the names the file binds them to.
    """

    @pytest.mark.parametrize("mode", MODES)
    @pytest.mark.parametrize("case", cases, ids=str)
    def test_float64_matches_plain_torch(case: Case, mode: str) -> None:
        check_float64_reference(case, mode)

    @pytest.mark.parametrize("case", cases, ids=str)
    def test_delayed_is_bitwise_immediate(case: Case) -> None:
        check_delayed_bitwise(case)

    def test_delayed_is_bitwise_immediate_bf16() -> None:
        check_delayed_bitwise(bf16_case, torch.bfloat16)

    return (
        test_float64_matches_plain_torch,
        test_delayed_is_bitwise_immediate,
        test_delayed_is_bitwise_immediate_bf16,
    )


def check_frozen(case: Case, frozen: list[str], *, mode: str = "delayed") -> None:
    """Frozen parameters get no gradient; the rest match the reference; pending work stays one task at most."""
    module = build(case, mode, torch.float64)
    for name in frozen:
        module.get_parameter(name).requires_grad_(False)
    owed = module.get_backward_dw_params()
    assert all(p.requires_grad for p in owed)
    got = run(case, mode, torch.float64, steps=2, module=module)
    ref_module = build(case, mode, torch.float64)
    for name in frozen:
        ref_module.get_parameter(name).requires_grad_(False)
    want = reference(case, torch.float64, steps=2, module=ref_module)
    if mode.startswith("fused"):
        attach_main_grad(ref_module, seed=1)
        for name, p in ref_module.named_parameters():
            if hasattr(p, "main_grad") and p.requires_grad:
                want[2][name] = want[2][name] + p.main_grad
    for name in frozen:
        assert got[2][name] is None, name
    assert_all_close(got, want, F64)


def check_rejects_wrong_answer(case: Case) -> None:
    """Not trivially passing: a reference run on different parameters must fail the comparison."""
    got = run(case, "delayed", torch.float64)
    wrong = build(case, "immediate", torch.float64)
    with torch.no_grad():
        wrong.get_backward_dw_params()[0].mul_(1.001)
    try:
        assert_all_close(got, reference(case, torch.float64, module=wrong), F64)
    except AssertionError:
        return
    raise AssertionError("a perturbed weight went unnoticed")


def norm_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    normalization: str,
    eps: float,
    zcg: bool,
) -> torch.Tensor:
    """Plain-torch LayerNorm / RMSNorm (``x * rsqrt(mean(x^2) + eps) * gamma``), zero-centered gamma aware."""
    gamma = 1 + weight if zcg else weight
    if normalization == "LayerNorm":
        return torch.nn.functional.layer_norm(x, (x.shape[-1],), gamma, bias, eps)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * gamma


def module_norm_reference(opts: dict, params: dict, x: torch.Tensor) -> torch.Tensor:
    """:func:`norm_reference` of a ``LayerNormLinear``/``LayerNormMLP`` built with ``opts`` (default ``eps``).

    Args:
        opts: the constructor keywords (``normalization``, ``zero_centered_gamma`` read, defaults TE's).
        params: the module's parameters by name (``layer_norm_weight``, optional ``layer_norm_bias``).
        x: ``(..., hidden)`` input.
    """
    return norm_reference(
        x,
        params["layer_norm_weight"],
        params.get("layer_norm_bias"),
        normalization=opts.get("normalization", "LayerNorm"),
        eps=1e-5,
        zcg=opts.get("zero_centered_gamma", False),
    )
