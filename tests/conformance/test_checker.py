"""The conformance checks reject wrong answers: each runs on a deliberately broken layer and must fail.

Why: a check that cannot fail proves nothing. Each broken layer below is a ``splitgrad.Linear`` subclass that
breaks exactly one clause of the contract through the public API, and the check for that clause (and, where
it says so, only a clause-specific message) must reject it.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections import OrderedDict

import pytest
import torch
from torch.utils.hooks import RemovableHandle

import splitgrad

from . import checks
from .cases import Case, _module_kw, case_named


def _broken(cls: type[splitgrad.Linear]) -> Case:
    return dataclasses.replace(
        case_named("Linear"),
        name=f"broken-{cls.__name__}",
        make=lambda d, f, t: cls(8, 5, **_module_kw(d, f, t)),
    )


class DoubledWgrad(splitgrad.Linear):
    """Writes twice the weight gradient at ``backward_dw``."""

    def backward_dw(self) -> None:
        super().backward_dw()
        with torch.no_grad():
            self.weight.grad.mul_(2)


class ReplacesMainGrad(splitgrad.Linear):
    """Fused: leaves the weight gradient in a new tensor instead of the wrapper's ``main_grad`` buffer."""

    def backward_dw(self) -> None:
        super().backward_dw()
        self.weight.main_grad = self.weight.main_grad.clone()


class HookTwice(splitgrad.Linear):
    """Registers every wgrad hook twice (so it fires twice per task)."""

    def register_wgrad_accumulation_and_reduce_hooks(self, hook):
        super().register_wgrad_accumulation_and_reduce_hooks(hook)
        return super().register_wgrad_accumulation_and_reduce_hooks(hook)


class HookBeforeWrite(splitgrad.Linear):
    """Fires its wgrad hooks before running the task that writes the gradients."""

    def register_wgrad_accumulation_and_reduce_hooks(self, hook):
        hooks = self.__dict__.setdefault("early_hooks", OrderedDict())
        handle = RemovableHandle(hooks)
        hooks[handle.id] = hook
        return handle

    def backward_dw(self) -> None:
        for hook in list(self.__dict__.get("early_hooks", {}).values()):
            hook()
        super().backward_dw()


class HandleRemovesNothing(splitgrad.Linear):
    """Returns a handle whose ``remove()`` does nothing."""

    def register_wgrad_accumulation_and_reduce_hooks(self, hook):
        super().register_wgrad_accumulation_and_reduce_hooks(hook)
        return RemovableHandle(OrderedDict())


class ListsWeightOnly(splitgrad.Linear):
    """``get_backward_dw_params()`` forgets the bias that ``backward_dw`` writes."""

    def get_backward_dw_params(self):
        return [self.weight]


class ListsFrozen(splitgrad.Linear):
    """``get_backward_dw_params()`` lists frozen parameters too."""

    def get_backward_dw_params(self):
        return [self.weight, self.bias]


class FrozenGetsZeros(splitgrad.Linear):
    """Writes a zero gradient into a frozen bias at ``backward_dw``."""

    def backward_dw(self) -> None:
        super().backward_dw()
        if not self.bias.requires_grad:
            self.bias.grad = torch.zeros_like(self.bias)


class NoSkipFlag(splitgrad.Linear):
    """Leaves ``skip_backward_post_hook`` False although it defers its gradients."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        for p in self.parameters():
            p.skip_backward_post_hook = False


class OverwritesGrad(splitgrad.Linear):
    """Keeps only the last task's weight gradient (overwrite instead of accumulate), via its own hook."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.__dict__["seen"] = None
        super().register_wgrad_accumulation_and_reduce_hooks(self._keep_last)

    def _keep_last(self) -> None:
        grad = self.weight.grad
        if self.__dict__["seen"] is not None:
            grad.sub_(self.__dict__["seen"])
        self.__dict__["seen"] = grad.clone()


class EagerDespiteDelay(splitgrad.Linear):
    """Defers, then runs its own pending work at the end of its backward (so nothing is ever owed)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if self.need_backward_dw():
            self.register_full_backward_hook(lambda module, grad_in, grad_out: module.backward_dw())


class SilentWhenIdle(splitgrad.Linear):
    """Swallows the error of ``backward_dw()`` with nothing pending."""

    def backward_dw(self) -> None:
        with contextlib.suppress(RuntimeError):
            super().backward_dw()


def test_broken_layers_are_otherwise_valid_linears():
    """Each broken layer breaks only its clause: an unrelated check passes on it (the break is targeted)."""
    checks.check_float64_reference(_broken(HookTwice), "delayed")
    checks.check_skip_backward_post_hook(_broken(DoubledWgrad), "delayed")
    checks.check_float64_reference(_broken(NoSkipFlag), "delayed")


def test_float64_reference_rejects_a_doubled_wgrad():
    with pytest.raises(AssertionError, match="vs float64 autograd: weight"):
        checks.check_float64_reference(_broken(DoubledWgrad), "delayed")


def test_float64_reference_rejects_a_replaced_main_grad_buffer():
    with pytest.raises(AssertionError, match=r"weight\.main_grad was replaced"):
        checks.check_float64_reference(_broken(ReplacesMainGrad), "fused_delayed")


def test_bitwise_rejects_a_doubled_wgrad():
    with pytest.raises(AssertionError, match="delayed vs immediate"):
        checks.check_bitwise_vs_immediate(_broken(DoubledWgrad), torch.float32)


def test_hooks_reject_a_hook_fired_twice():
    with pytest.raises(AssertionError, match="fired 2x, want 1"):
        checks.check_hooks(_broken(HookTwice), "delayed")


def test_hooks_reject_a_hook_fired_before_the_write():
    with pytest.raises(AssertionError, match="fired before its gradient"):
        checks.check_hooks(_broken(HookBeforeWrite), "delayed")


def test_hooks_reject_a_handle_that_removes_nothing():
    with pytest.raises(AssertionError, match="removed hooks fired again"):
        checks.check_hooks(_broken(HandleRemovesNothing), "delayed")


def test_backward_dw_params_rejects_a_missing_parameter():
    with pytest.raises(
        AssertionError, match=r"wrote \['bias', 'weight'\], get_backward_dw_params\(\) lists \['weight'\]"
    ):
        checks.check_backward_dw_params(_broken(ListsWeightOnly), "delayed")


def test_frozen_rejects_a_listed_frozen_parameter():
    with pytest.raises(AssertionError, match="lists a frozen parameter"):
        checks.check_frozen(_broken(ListsFrozen), "delayed")


def test_frozen_rejects_a_gradient_on_a_frozen_parameter():
    with pytest.raises(AssertionError, match="frozen bias got a gradient"):
        checks.check_frozen(_broken(FrozenGetsZeros), "delayed")


def test_skip_flag_rejects_a_missing_flag():
    with pytest.raises(AssertionError, match="skip_backward_post_hook=False, want True"):
        checks.check_skip_backward_post_hook(_broken(NoSkipFlag), "delayed")


def test_bundles_reject_order_dependent_accumulation():
    with pytest.raises(AssertionError, match=r"bundles run \[1, 0, 2\] vs FIFO"):
        checks.check_bundles_any_order(_broken(OverwritesGrad), "delayed")


def test_idle_rejects_a_silent_backward_dw():
    with pytest.raises(pytest.fail.Exception, match="DID NOT RAISE"):
        checks.check_idle_backward_dw_raises(_broken(SilentWhenIdle), "delayed")


def test_bitwise_claim_about_orders_is_needed():
    """Why bundles in a non-FIFO order are compared float64-close, not bitwise: a third addend does not
    associate, so some orders really do change bits, while swapping the first two never does."""
    gen = torch.Generator().manual_seed(0)
    a, b, c = (torch.randn(4096, generator=gen) for _ in range(3))
    assert torch.equal(a + b, b + a)
    assert not torch.equal((a + b) + c, (a + c) + b)
    assert checks.bitwise_order_independent([1, 0, 2], "delayed")
    assert not checks.bitwise_order_independent([0, 2, 1], "delayed")
    assert not checks.bitwise_order_independent([1, 0, 2], "fused_delayed")


def test_fifo_drain_rejects_a_doubled_wgrad():
    with pytest.raises(AssertionError, match="drained at end vs immediate"):
        checks.check_fifo_drain(_broken(DoubledWgrad), torch.float32)


def test_owed_work_rejects_a_layer_that_owes_nothing():
    with pytest.raises(pytest.fail.Exception, match="DID NOT RAISE"):
        checks.check_owed_work_is_visible(_broken(EagerDespiteDelay), "delayed")
