"""Imports point one way: core -> functional -> distributed -> module / ops -> models -> parallel / graphs -> pipeline
-> integrations -> cli.

Why: the layout is meant to show the architecture (CONVENTIONS.md, README's Layout). A lower layer importing a
higher one, ``module/`` and ``ops/`` importing each other, or one package reaching into another's private
(``_``-prefixed) file is how that erodes; the checks read every import statement of ``src/splitgrad`` (top
level, inside functions and under ``TYPE_CHECKING`` alike) with ``ast``, so a lazy import cannot hide an edge.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).parents[1] / "src" / "splitgrad"

#: Layer of each top-level part of the package (equal numbers: siblings).
LAYERS = {
    "core": 0,
    "functional": 1,  # pure kernels: no process groups
    "distributed": 2,  # process-group plumbing: group references, TP collectives, launch, teardown, waits
    "module": 3,
    "ops": 3,
    "convert": 3,  # torch.nn.Linear -> splitgrad.Linear: built on module/
    "models": 4,  # the demo models: parallel/ builds its expert-parallel twins from their parts
    "parallel": 5,
    "graphs": 5,
    "pipeline": 6,
    "integrations": 7,  # other people's frameworks (torchtitan, ...), each imported lazily
    "testing": 8,  # test doubles and references: may use anything below the CLI; the library never imports it
    "cli": 9,
    "__main__": 9,
    "": 9,  # the package facade (splitgrad/__init__.py) re-exports from every layer
}
#: Siblings that must not import each other.
SEPARATE = {frozenset({"module", "ops"})}
#: Upward edges allowed on purpose, with the reason.
ALLOWED = {
    # One torch-free action grammar (issue 12): capture orders are read with the pipeline's parser.
    # pipeline/ir/actions.py imports only the standard library, so no cycle and nothing heavy comes with it.
    ("splitgrad.graphs.order", "splitgrad.pipeline.ir.actions"),
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _type_only_nodes(tree: ast.AST) -> set[int]:
    """ids of the import nodes under ``if TYPE_CHECKING:`` (they never run, so they close no runtime cycle)."""
    ids: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            ids.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return ids


def _imports(path: Path, *, runtime_only: bool = False) -> set[str]:
    """Every ``splitgrad...`` module (or module.name) this file imports, absolute (``runtime_only``: leave out
    the imports under ``TYPE_CHECKING``)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    tree = ast.parse(path.read_text())
    skip = _type_only_nodes(tree) if runtime_only else set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] == "splitgrad":
                found.add(target)
                found.update(f"{target}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "splitgrad")
    return found


def _graph(*, runtime_only: bool = False) -> dict[str, set[str]]:
    """``{module: modules it imports}`` over the package's own modules."""
    files = {_module_name(p): p for p in SRC.rglob("*.py")}
    return {
        m: {t for t in _imports(p, runtime_only=runtime_only) if t in files and t != m}
        for m, p in files.items()
    }


def _part(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def layering_problems(graph: dict[str, set[str]]) -> list[str]:
    """Every edge that breaks the direction, the sibling rule or the private-file rule."""
    problems = []
    for src, targets in sorted(graph.items()):
        for dst in sorted(targets):
            a, b = _part(src), _part(dst)
            if a == b or (src, dst) in ALLOWED:
                continue
            if b == "":
                # The facade is the top layer; only the CLI (and the facade's own lazy lookups) may use it.
                if LAYERS[a] < LAYERS["cli"]:
                    problems.append(f"{src} imports the package facade `splitgrad` (layer {a!r})")
                continue
            if LAYERS[b] > LAYERS[a]:
                problems.append(f"{src} (layer {a!r}) imports {dst} (higher layer {b!r})")
            if frozenset({a, b}) in SEPARATE:
                problems.append(f"{src} imports its sibling {dst}")
            private = [p for p in dst.split(".")[2:] if p.startswith("_")]
            if private:
                problems.append(f"{src} imports {dst}, a private module of package {b!r}")
    return problems


def private_name_imports(module: str, source: str, *, is_package: bool = False) -> list[str]:
    """``from <another package> import _name`` in ``source`` (the file of ``module``)."""
    package = module if is_package else module.rsplit(".", 1)[0]
    problems = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level:
            base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
            target = ".".join(base + ([node.module] if node.module else []))
        else:
            target = node.module or ""
        if target.split(".")[0] != "splitgrad" or _part(target) == _part(module):
            continue
        for alias in node.names:
            if alias.name.startswith("_") and not alias.name.startswith("__"):
                problems.append(f"{module} imports the private name {alias.name} from {target}")
    return problems


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_every_layer_is_known():
    unknown = sorted({_part(m) for m in _graph()} - set(LAYERS))
    assert not unknown, f"add these parts of src/splitgrad to LAYERS (and to README's Layout): {unknown}"


def test_imports_point_one_way():
    problems = layering_problems(_graph())
    assert not problems, "\n".join(problems)


def test_no_private_names_across_packages():
    problems = [
        problem
        for path in SRC.rglob("*.py")
        for problem in private_name_imports(
            _module_name(path), path.read_text(), is_package=path.name == "__init__.py"
        )
    ]
    assert not problems, "\n".join(problems)
    # Negative check: the scan reports one.
    bad = private_name_imports("splitgrad.ops.linear", "from ..module.linear import _LinearFunction\n")
    assert bad == [
        "splitgrad.ops.linear imports the private name _LinearFunction from splitgrad.module.linear"
    ]


def test_no_import_cycles_between_packages():
    # Type-only imports (under TYPE_CHECKING) are left out here: they never run, so they close no cycle; the
    # layering checks above still count them.
    found = cycles(_graph(runtime_only=True))
    assert not found, f"import cycles: {found}"


@pytest.mark.parametrize(
    ("edge", "expected"),
    [
        (("splitgrad.core.store", "splitgrad.module.linear"), "higher layer 'module'"),
        (("splitgrad.ops.linear", "splitgrad.module.linear"), "imports its sibling"),
        (
            ("splitgrad.pipeline.runtime", "splitgrad.module._linear_wgrad"),
            "private module of package 'module'",
        ),
        (("splitgrad.models.gpt", "splitgrad"), "package facade"),
        (("splitgrad.graphs.api", "splitgrad.pipeline.runtime"), "higher layer 'pipeline'"),
        (("splitgrad.functional.wgrad", "splitgrad.distributed.group_ref"), "higher layer 'distributed'"),
        (("splitgrad.distributed.tp_comm", "splitgrad.module.linear"), "higher layer 'module'"),
        (("splitgrad.models.moe", "splitgrad.parallel.expert.layer"), "higher layer 'parallel'"),
    ],
)
def test_the_checks_reject_a_wrong_edge(edge, expected):
    # Negative checks: each rule reports an edge that breaks it (so a green run means something).
    graph = _graph()
    src, dst = edge
    graph[src] = graph[src] | {dst}
    assert any(expected in p for p in layering_problems(graph))
    looped = _graph()
    looped["splitgrad.ops.fuser"] = looped["splitgrad.ops.fuser"] | {"splitgrad.ops.op"}
    assert any("splitgrad.ops.op" in c for c in cycles(looped))
