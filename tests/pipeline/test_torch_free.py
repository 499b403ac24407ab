"""The schedule side of the pipeline imports no torch: every module of ``pipeline/ir``, ``schedules``, ``passes``
and ``timeline``, found by walking those folders, so a new file there is covered without editing a list.

Why: schedules are built, validated, simulated and drawn where no model runs (the ``schedule`` CLI, the
goldens, a planner), and every runtime process imports this layer; torch takes seconds to import, matplotlib
and numpy are optional. A check inside the test process cannot see an import (other tests loaded torch long
ago), so each module is imported in a fresh interpreter, with ``splitgrad`` as a bare namespace: its
``__init__`` exports the torch layers, which is not what is measured here (``splitgrad.pipeline``'s own
``__init__`` is, and runs for every module below it).
"""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "splitgrad"
TORCH_FREE_ROOMS = ("ir", "schedules", "passes", "timeline")
HEAVY = ("torch", "matplotlib", "numpy")


def torch_free_modules() -> list[str]:
    """Every module under the torch-free rooms, the ``splitgrad.pipeline`` package with the public aliases of
    ir modules at its top, and the CLI that draws schedules."""
    found = ["splitgrad.pipeline", "splitgrad.cli.schedule"]
    found += [f"splitgrad.pipeline.{alias}" for alias in ("actions", "simulate", "validate")]
    for room in TORCH_FREE_ROOMS:
        for path in sorted((SRC / "pipeline" / room).rglob("*.py")):
            parts = path.relative_to(SRC.parent).with_suffix("").parts
            found.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return found


def heavy_loaded_by(snippet: str) -> list[str]:
    """The heavy modules (torch, matplotlib, numpy) in ``sys.modules`` after ``snippet`` runs in a fresh
    interpreter where ``splitgrad`` is a bare namespace package."""
    probe = (
        f"import json, sys, types\n"
        f"root = types.ModuleType('splitgrad')\n"
        f"root.__path__ = [{str(SRC)!r}]\n"
        f"sys.modules['splitgrad'] = root\n"
        f"{snippet}\n"
        f"print(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, check=False
    )
    if out.returncode != 0:
        raise RuntimeError(f"probe failed for {snippet!r}:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def heavy_imports(modules: list[str]) -> dict[str, list[str]]:
    """``{module: heavy modules its import loads}`` for each module that loads any (one interpreter each)."""
    with ThreadPoolExecutor(max_workers=4) as pool:
        loaded = pool.map(lambda m: heavy_loaded_by(f"import {m}"), modules)
    return {m: heavy for m, heavy in zip(modules, loaded) if heavy}


def test_the_rooms_are_found_from_the_folders():
    modules = torch_free_modules()
    # Not trivially passing: each room contributes its modules (private ones too), and no runtime module.
    for expected in (
        "splitgrad.pipeline.ir.actions",
        "splitgrad.pipeline.ir._engine",
        "splitgrad.pipeline.schedules.zbv_auto",
        "splitgrad.pipeline.passes.w_refill",
        "splitgrad.pipeline.timeline.analysis",
    ):
        assert expected in modules
    assert not [m for m in modules if ".runtime" in m or m.endswith("torch_adapter")]
    assert len(modules) >= 30


def test_importing_each_torch_free_module_loads_no_heavy_module():
    offenders = heavy_imports(torch_free_modules())
    assert not offenders, "\n".join(f"importing {m} loads {heavy}" for m, heavy in offenders.items())


def test_using_the_schedule_layer_loads_no_heavy_module():
    """Build, validate, simulate, draw and analyse: the lazy imports inside the functions stay torch-free."""
    snippet = (
        "from splitgrad.pipeline import build_schedule, simulate, validate\n"
        "from splitgrad.pipeline.passes import add_grad_sync\n"
        "from splitgrad.pipeline.timeline import bubble_report, idle_breakdown\n"
        "s = add_grad_sync(build_schedule('zbv-auto', 4, 6, b=2.0))\n"
        "validate(s)\n"
        "r = simulate(s, comm=0.1)\n"
        "assert r.to_ascii() and r.to_chrome_trace()['traceEvents']\n"
        "events = [e._replace(start=e.start * 1e-3, end=e.end * 1e-3) for e in r.events()]\n"
        "assert 'measured bubble' in bubble_report(events, s) and idle_breakdown(events)\n"
    )
    assert heavy_loaded_by(snippet) == []


def test_the_probe_reports_a_module_that_imports_torch():
    # Negative check: the runtime's modules import torch, and the probe says so (by name, with what it loaded).
    offenders = heavy_imports(["splitgrad.pipeline.ir.actions", "splitgrad.pipeline.runtime.recording"])
    assert list(offenders) == ["splitgrad.pipeline.runtime.recording"]
    assert "torch" in offenders["splitgrad.pipeline.runtime.recording"]
