"""The layers point one way: `bench` and `tests` may import the services and the SDK, never the
reverse. Read from the source with `ast` (no module is imported), so a lazy import inside a
function counts as much as one at the top."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PRODUCTION = ("services", "blitzmesh")
# Generated protobuf modules: they import each other as protoc writes them.
GENERATED = ("blitzmesh/v1",)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules(*tops: str) -> dict[str, Path]:
    """Every Python file under `tops`, by dotted module name."""
    return {module_name(p): p for top in tops for p in sorted((REPO / top).rglob("*.py"))}


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
    assert offenders == [], "production code must not depend on the benchmarks or the tests: " + "; ".join(
        offenders
    )


def test_the_finder_sees_relative_and_lazy_imports(tmp_path: Path) -> None:
    source = "from . import sibling\nfrom ..up import thing\n\ndef f():\n    import bench.x\n"
    (tmp_path / "m.py").write_text(source)
    names = imported_names("services.pkg.m", tmp_path / "m.py")
    assert names == {"services.pkg.sibling", "services.up.thing", "bench.x"}
