"""The split contract over every registered split-capable case (modules, ops, ``Sequential``, graphs).

Why: each class used to have its own copy of these checks, with different gaps. One suite, one registry
(:mod:`tests.conformance.cases`): a new class gets every clause by adding one entry. The torch-adapter stage,
driven by PyTorch's schedules rather than called directly, has its own file (``test_adapter_stage.py``).
"""

from __future__ import annotations

import pytest
import torch

from . import checks
from .cases import CASES, MODES, Case


def _grid(modes: tuple[str, ...], *, when=lambda case: True) -> list:
    return [
        pytest.param(case, mode, id=f"{case.name}-{mode}")
        for case in CASES
        if when(case)
        for mode in modes
        if mode in case.modes
    ]


@pytest.mark.parametrize(("case", "mode"), _grid(MODES))
def test_float64_reference(case: Case, mode: str) -> None:
    checks.check_float64_reference(case, mode)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_bitwise_vs_immediate(case: Case, dtype: torch.dtype) -> None:
    checks.check_bitwise_vs_immediate(case, dtype)


@pytest.mark.parametrize("case", [c for c in CASES if not c.graphed], ids=str)
def test_fifo_drain_after_several_backwards(case: Case) -> None:
    # Graphed callables hold one microbatch in flight (a second backward before backward_dw is refused).
    checks.check_fifo_drain(case, torch.float32)


@pytest.mark.parametrize(("case", "mode"), _grid(("delayed", "fused_delayed")))
def test_owed_work_is_visible(case: Case, mode: str) -> None:
    checks.check_owed_work_is_visible(case, mode)


@pytest.mark.parametrize(("case", "mode"), _grid(MODES))
def test_hooks_once_per_task_after_write(case: Case, mode: str) -> None:
    checks.check_hooks(case, mode)


@pytest.mark.parametrize(("case", "mode"), _grid(("delayed", "fused_delayed")))
def test_get_backward_dw_params_is_what_backward_dw_writes(case: Case, mode: str) -> None:
    checks.check_backward_dw_params(case, mode)


@pytest.mark.parametrize(("case", "mode"), _grid(MODES))
def test_skip_backward_post_hook(case: Case, mode: str) -> None:
    checks.check_skip_backward_post_hook(case, mode)


@pytest.mark.parametrize(("case", "mode"), _grid(MODES, when=lambda c: bool(c.frozen)))
def test_frozen_parameters(case: Case, mode: str) -> None:
    checks.check_frozen(case, mode)


@pytest.mark.parametrize(("case", "mode"), _grid(("delayed", "fused_delayed"), when=lambda c: c.bundles))
def test_bundles_in_any_order(case: Case, mode: str) -> None:
    checks.check_bundles_any_order(case, mode)


@pytest.mark.parametrize(("case", "mode"), _grid(("immediate", "delayed")))
def test_idle_backward_dw_raises(case: Case, mode: str) -> None:
    checks.check_idle_backward_dw_raises(case, mode)
