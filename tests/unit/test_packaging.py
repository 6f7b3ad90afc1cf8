"""The demo in a package of its own beside the daemon: the daemon never imports
it, and its report does not import its runner. Files are parsed, not imported."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "pacerd_demo"


# -- the demo beside the daemon ------------------------------------------------------


def imported_modules(path: Path) -> set[str]:
    """Every module ``path`` imports, at any level (also under TYPE_CHECKING or
    inside a function), as absolute names."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            assert node.level == 0, f"{path}: relative import"
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def demo_modules() -> dict[str, set[str]]:
    """Module of pacerd_demo → the modules of pacerd_demo it imports."""
    graph: dict[str, set[str]] = {}
    for path in sorted(DEMO.glob("*.py")):
        name = f"pacerd_demo.{path.stem}" if path.stem != "__init__" else "pacerd_demo"
        graph[name] = {
            m for m in imported_modules(path) if m.startswith("pacerd_demo.") and m != name
        }
    return {name: {m for m in deps if m in graph} for name, deps in graph.items()}


def test_the_daemons_package_never_imports_the_demo() -> None:
    for path in sorted((ROOT / "pacerd").rglob("*.py")):
        demo = {m for m in imported_modules(path) if m.split(".")[0] == "pacerd_demo"}
        assert demo == set(), path.relative_to(ROOT)
    assert not list((ROOT / "pacerd" / "testing").glob("demo*.py"))


def test_the_demos_imports_go_one_way() -> None:
    graph = demo_modules()
    assert {"pacerd_demo.runner", "pacerd_demo.report", "pacerd_demo.plan"} <= set(graph)
    assert "pacerd_demo.runner" not in graph["pacerd_demo.report"]
    assert graph["pacerd_demo.plan"] == set()

    def reaches(start: str, seen: frozenset[str]) -> None:
        for dependency in graph[start]:
            assert dependency not in seen, f"import cycle: {' → '.join([*seen, dependency])}"
            reaches(dependency, seen | {dependency})

    for module in graph:
        reaches(module, frozenset({module}))
