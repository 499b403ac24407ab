"""`import splitgrad` loads the core and the modules only; every subpackage loads on first use.

Why: the subpackages pull in the pipeline runtime, torch.distributed's collectives wrappers, CUDA-graph
machinery and (for PNGs) matplotlib. A check inside the test process cannot see this, because other tests have
already imported everything: each check runs in a fresh interpreter.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import splitgrad

SUBPACKAGES = ("graphs", "integrations", "models", "ops", "parallel", "pipeline", "testing")
_SRC = str(Path(splitgrad.__file__).resolve().parents[1])  # the splitgrad under test, not an installed one


def loaded_after(snippet: str) -> list[str]:
    """Run ``snippet`` in a fresh interpreter; return the splitgrad subpackages (and matplotlib) it loaded."""
    probe = (
        f"{snippet}\n"
        "import json, sys\n"
        f"watched = [f'splitgrad.{{name}}' for name in {SUBPACKAGES!r}] + ['matplotlib']\n"
        "print(json.dumps(sorted(m for m in watched if m in sys.modules)))\n"
    )
    env = {**os.environ, "PYTHONPATH": _SRC}
    proc = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=300, check=False
    )
    if proc.returncode != 0:
        raise RuntimeError(f"probe failed (rc={proc.returncode}):\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def check_lazy(snippet: str) -> None:
    """Raise AssertionError naming every subpackage that ``snippet`` (an import of splitgrad) loaded eagerly."""
    eager = loaded_after(snippet)
    assert not eager, f"loaded eagerly by {snippet!r}: {eager}"


def test_import_splitgrad_loads_no_subpackage():
    check_lazy("import splitgrad")


def test_the_check_sees_an_eager_subpackage_import():
    # Negative check: the same probe must report a subpackage that an import does load.
    with pytest.raises(AssertionError, match=r"splitgrad\.graphs"):
        check_lazy("import splitgrad, splitgrad.graphs")
    assert loaded_after("import splitgrad.pipeline") == ["splitgrad.pipeline"]


def test_lazy_names_resolve_to_the_subpackage_objects():
    from splitgrad import GraphCaptureError, GraphedCallable, make_graphed_callables
    from splitgrad.graphs import api, errors, graphed

    assert make_graphed_callables is api.make_graphed_callables
    assert GraphedCallable is graphed.GraphedCallable
    assert GraphCaptureError is errors.GraphCaptureError
    assert splitgrad.ops.Sequential is not None
    for name in splitgrad.__all__:
        assert getattr(splitgrad, name) is not None, name
    assert {"make_graphed_callables", "graphs", "ops"} <= set(dir(splitgrad))
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        splitgrad.nope  # noqa: B018


def test_first_access_of_a_lazy_name_loads_only_its_subpackage():
    assert loaded_after("from splitgrad import make_graphed_callables") == ["splitgrad.graphs"]
