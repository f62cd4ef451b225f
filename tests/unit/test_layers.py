"""The layers point one way: `bench` and `tests` may import the services and the SDK, never the
reverse, and no two files import each other, directly or around a circle. Read from the source
with `ast` (no module is imported), so a lazy import inside a function, or one under
`TYPE_CHECKING`, counts as much as one at the top."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PRODUCTION = ("services", "blitzmesh")
SCANNED = ("services", "blitzmesh", "bench")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules(*tops: str) -> dict[str, Path]:
    """Every Python file under `tops`, by dotted module name (not hidden folders such as the
    benchmarks' virtual environments, bench/.envs)."""
    return {
        module_name(p): p
        for top in tops
        for p in sorted((REPO / top).rglob("*.py"))
        if not any(part.startswith(".") for part in p.relative_to(REPO).parts)
    }


def imported_names(name: str, path: Path) -> set[str]:
    """The dotted names `path` imports, relative imports resolved; for `from a import b` the name
    is `a.b` (callers trim it to the module that exists)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package
                for _ in range(node.level - 1):
                    anchor = anchor.rpartition(".")[0]
                base = f"{anchor}.{base}" if base else anchor
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def test_no_production_module_imports_bench_or_tests() -> None:
    offenders = sorted(
        f"{name} imports {imported}"
        for name, path in modules(*PRODUCTION).items()
        for imported in imported_names(name, path)
        if imported.split(".")[0] in ("bench", "tests")
    )
    assert offenders == [], "production code must not depend on the benchmarks or the tests: " + "; ".join(offenders)


def import_graph(found: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the scanned modules it imports, each name trimmed to the longest module that
    exists (`from a import b` is `a.b` when b is a module, else `a`)."""
    graph: dict[str, set[str]] = {}
    for name, path in found.items():
        edges: set[str] = set()
        for imported in imported_names(name, path):
            while imported and imported not in found:
                imported = imported.rpartition(".")[0]
            if imported and imported != name:
                edges.add(imported)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_import_cycle_between_files() -> None:
    circles = cycles(import_graph(modules(*SCANNED)))
    assert circles == [], "files that import each other (move the shared part to a leaf module): " + "; ".join(
        " <-> ".join(c) for c in circles
    )


def test_the_cycle_finder_finds_a_circle_of_three_and_ignores_a_diamond() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"e", "f"}, "e": {"g"}, "f": {"g"}, "g": set()}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({k: v for k, v in graph.items() if k != "c"} | {"c": set()}) == []


def test_the_finder_sees_relative_and_lazy_imports(tmp_path: Path) -> None:
    source = "from . import sibling\nfrom ..up import thing\n\ndef f():\n    import bench.x\n"
    (tmp_path / "m.py").write_text(source)
    names = imported_names("services.pkg.m", tmp_path / "m.py")
    assert names == {"services.pkg.sibling", "services.up.thing", "bench.x"}
