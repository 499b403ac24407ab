"""docs/core.md's code blocks run as written, and the layering it describes holds.

Why: the custom-layer example is how users extend the contract with public names only; the package layering
(``core -> functional -> module / ops``, ``ops`` never importing ``module``) is what lets ops and modules
evolve separately.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import torch

import splitgrad

ROOT = Path(__file__).parents[2]
BLOCKS = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "core.md").read_text(), flags=re.S)


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_docs_core_code_blocks_run(index):
    exec(compile(BLOCKS[index], f"docs/core.md[{index}]", "exec"), {"__name__": "docs_core"})


def test_docs_core_has_the_custom_layer_example():
    assert len(BLOCKS) >= 2 and "class Scale(SplitModule)" in BLOCKS[0]
    for name in re.findall(r"from splitgrad[\w.]* import ([\w, ]+)", BLOCKS[0]):
        assert not any(n.strip().startswith("_") for n in name.split(",")), name


def _imports(package: str) -> list[tuple[str, str]]:
    """``(file, imported module)`` for every relative import under ``src/splitgrad/<package>``."""
    found = []
    for path in (ROOT / "src" / "splitgrad" / package).rglob("*.py"):
        rel = path.relative_to(ROOT / "src")
        parts = list(rel.with_suffix("").parts)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                base = parts[: len(parts) - node.level]
                found.append((str(rel), ".".join([*base, *([node.module] if node.module else [])])))
    return found


@pytest.mark.parametrize(
    ("package", "forbidden"),
    [("ops", "splitgrad.module"), ("module", "splitgrad.ops"), ("core", "splitgrad.module"),
     ("core", "splitgrad.ops"), ("functional", "splitgrad.module"), ("functional", "splitgrad.ops"),
     ("functional", "splitgrad.core")],
)  # fmt: skip
def test_dependencies_point_one_way(package, forbidden):
    bad = [(f, m) for f, m in _imports(package) if m == forbidden or m.startswith(forbidden + ".")]
    assert bad == []


def test_no_private_cross_package_imports():
    bad = []
    for package in ("core", "functional", "module", "ops"):
        for f, m in _imports(package):
            head = m.split(".")[1] if m.count(".") else ""
            if head != package and any(p.startswith("_") for p in m.split(".")[2:]):
                bad.append((f, m))
    assert bad == []


def test_layering_check_is_not_trivially_passing():
    assert any(m.startswith("splitgrad.core") for _, m in _imports("ops"))


def test_split_capable_protocol():
    for layer in (splitgrad.Linear(2, 2), splitgrad.ops.Linear(2, 2), splitgrad.ops.BasicLinear(2, 2)):
        assert isinstance(layer, splitgrad.SplitCapable) and splitgrad.core.is_split_capable(layer)
    seq = splitgrad.ops.Sequential(splitgrad.ops.Linear(2, 2))
    assert not splitgrad.core.is_split_capable(seq)  # a container: the layers inside are found
    assert [type(m).__name__ for _, m in splitgrad.split_modules(seq)] == ["Linear"]
    impostor = torch.nn.Linear(2, 2)
    impostor.wgrad_store = "not a store"
    assert not splitgrad.core.is_split_capable(impostor)


def test_split_capable_is_structural_and_needs_every_method():
    """is_split_capable spells out the protocol check (fast): same answer as isinstance(.., SplitCapable)."""

    class Duck:
        def __init__(self) -> None:
            self.wgrad_store = splitgrad.WeightGradStore()

        def need_backward_dw(self) -> bool:
            return False

        def backward_dw(self) -> None: ...

        def register_wgrad_accumulation_and_reduce_hooks(self, hook): ...

        def get_backward_dw_params(self) -> list:
            return []

    duck = Duck()
    assert splitgrad.core.is_split_capable(duck) and isinstance(duck, splitgrad.SplitCapable)
    methods = ("need_backward_dw", "backward_dw", "register_wgrad_accumulation_and_reduce_hooks")
    for method in (*methods, "get_backward_dw_params"):
        lame = Duck()
        setattr(lame, method, None)  # present but not callable
        assert not splitgrad.core.is_split_capable(lame), method
    del duck.wgrad_store
    assert not splitgrad.core.is_split_capable(duck)
