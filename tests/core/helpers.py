"""Shared test utilities for the core contract: exact/float64 comparisons of gradient snapshots
(snapshots and ``main_grad`` buffers: :mod:`tests.helpers`)."""

from __future__ import annotations

import torch


def assert_same(a: dict, b: dict, *, exact: bool = True, rtol: float = 1e-10, atol: float = 1e-12) -> None:
    """Every entry equal (bitwise when ``exact``) and the same set of Nones."""
    assert a.keys() == b.keys(), (a.keys(), b.keys())
    for k in a:
        if a[k] is None or b[k] is None:
            assert a[k] is None and b[k] is None, f"{k}: one side is None"
            continue
        if exact:
            torch.testing.assert_close(a[k], b[k], rtol=0, atol=0, msg=lambda m, k=k: f"{k}: {m}")
        else:
            torch.testing.assert_close(a[k], b[k], rtol=rtol, atol=atol, msg=lambda m, k=k: f"{k}: {m}")
