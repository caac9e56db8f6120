"""The import graph: no cycles, and the layers of docs/design.md §4 (hf -> loss -> backends).

Every ``import`` / ``from ... import`` of the package's own modules counts, including the ones
inside functions (a late import is still a dependency; it only hides the cycle from Python).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "fused_ce_patch"


def _module_name(path: Path, base: Path, prefix: str) -> str:
    parts = list(path.relative_to(base).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join([prefix, *parts]) if prefix else ".".join(parts)


def _graph(base: Path, prefix: str, files) -> dict[str, set[str]]:
    names = {_module_name(f, base, prefix): f for f in files}
    graph = {name: set() for name in names}
    for name, path in names.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = []
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    anchor = package.split(".")
                    anchor = anchor[: len(anchor) - node.level + 1]
                    mod = ".".join(anchor + ([node.module] if node.module else []))
                else:
                    mod = node.module or ""
                targets = [mod] + [f"{mod}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            for target in targets:
                # the longest known module the import names (a name imported from a module
                # counts as that module)
                while target and target not in names:
                    target = target.rpartition(".")[0]
                if target and target != name and not name.startswith(target + "."):
                    graph[name].add(target)
    return graph


def _cycles(graph) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
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
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def _package_graph():
    files = [p for p in PACKAGE.rglob("*.py")]
    return _graph(ROOT, "", files)


def test_package_has_no_import_cycles():
    # a package's __init__ importing its own submodules is not a cycle of rooms
    graph = {k: {t for t in v if not t.startswith(k + ".")} for k, v in _package_graph().items()}
    assert _cycles(graph) == []


def test_benchmarks_have_no_import_cycles():
    files = [p for p in (ROOT / "benchmarks").glob("*.py")]
    assert _cycles(_graph(ROOT / "benchmarks", "", files)) == []


@pytest.mark.parametrize("layer, forbidden", [
    ("fused_ce_patch.backends", ("fused_ce_patch.hf", "fused_ce_patch.loss",
                                 "fused_ce_patch.token_stats", "fused_ce_patch.ops",
                                 "fused_ce_patch.distill")),
    ("fused_ce_patch.hf", ("fused_ce_patch.backends",)),
])
def test_layers_point_one_way(layer, forbidden):
    """Backends know nothing of transformers or the public API; hf speaks through the loss API."""
    bad = sorted((m, t) for m, deps in _package_graph().items()
                 if m == layer or m.startswith(layer + ".")
                 for t in deps if any(t == f or t.startswith(f + ".") for f in forbidden))
    assert bad == []
