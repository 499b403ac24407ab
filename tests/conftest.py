"""Suite-wide guards: no test may leave a capture_wgrad block open (it would swallow later tests' work)."""

from __future__ import annotations

import pytest

from splitgrad.core.bundle import active_bundle


@pytest.fixture(autouse=True)
def _no_leaked_capture():
    yield
    leaked = active_bundle()
    assert leaked is None, f"a capture_wgrad block was left open: {leaked!r}"
