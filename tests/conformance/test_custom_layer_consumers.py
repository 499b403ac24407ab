"""The extension example works where the library's own layers work: DDP and the pipeline runtime.

Why: issue 12 asks that a split layer written with public names only (``examples/custom_split_layer.py``)
pass the conformance suite (``cases.py`` registers it) *and* plug into the consumers of the contract. Both
consumers run in one 2-rank gloo spawn; each check is its own test.
"""

from __future__ import annotations

import pytest

from splitgrad.testing import spawn
from tests.conformance import custom_layer_checks

pytestmark = pytest.mark.distributed

NAMES = list(custom_layer_checks.CHECKS)


@pytest.fixture(scope="module")
def results() -> list[dict[str, str | None]]:
    return spawn(custom_layer_checks.run_checks, 2, NAMES, timeout=240, pg_timeout=60)


@pytest.mark.parametrize("name", NAMES)
def test_custom_split_layer_in_consumer(results, name):
    failures = [f"--- rank {r} ---\n{res[name]}" for r, res in enumerate(results) if res[name] is not None]
    assert not failures, "\n".join(failures)


def test_the_example_runs_and_matches_torch_embedding(capsys):
    from tests.conformance.cases import custom_split_layer_module

    custom_split_layer_module().main()
    assert "max |difference| = 0.0e+00" in capsys.readouterr().out
