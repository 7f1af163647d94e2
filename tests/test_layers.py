"""The package's layers: no import loop between its folders (subpackages) and top-level modules, so a lower
layer never imports a higher one. Imports inside functions count: they are dependencies all the same."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).parent.parent / "kokoro_opt"


def _unit(module: str) -> str:
    """A subpackage ('serve/') or a top-level module ('build')."""
    parts = module.split(".")
    if len(parts) > 1 and (PACKAGE / parts[1]).is_dir():
        return parts[1] + "/"
    return parts[1] if len(parts) > 1 else "kokoro_opt"


def import_graph() -> dict[str, dict[str, set[str]]]:
    """unit -> unit it imports -> the files that do."""
    edges: dict[str, dict[str, set[str]]] = {}
    for path in PACKAGE.rglob("*.py"):
        module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names = [f"{node.module}.{a.name}" for a in node.names] if node.module == "kokoro_opt" else [node.module]
            else:
                continue
            for name in names:
                if name.startswith("kokoro_opt.") and _unit(name) != _unit(module):
                    edges.setdefault(_unit(module), {}).setdefault(_unit(name), set()).add(path.name)
    return edges


def loops(edges: dict[str, dict[str, set[str]]]) -> list[list[str]]:
    """Strongly connected groups of more than one unit (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in list(edges):
        if v not in index:
            visit(v)
    return found


def test_no_loop_between_folders() -> None:
    edges = import_graph()
    assert "runtime/" in edges and "serve/" in edges  # the graph was read
    problems = [
        f"{a} -> {b} ({', '.join(sorted(edges[a][b]))})"
        for group in loops(edges)
        for a in group
        for b in group
        if b in edges.get(a, {})
    ]
    assert not problems, "import loops: " + "; ".join(problems)


def test_the_runtime_imports_no_build_evaluate_tune_or_serve_code() -> None:
    higher = {"passes/", "evaluate/", "tuning/", "serve/", "build", "export", "cli", "select", "targets", "remote"}
    assert not set(import_graph().get("runtime/", {})) & higher


def test_the_check_finds_a_loop() -> None:
    assert loops({"a": {"b": {"x.py"}}, "b": {"c": {"y.py"}}, "c": {"a": {"z.py"}}, "d": {"a": {"w.py"}}}) == [["a", "b", "c"]]
