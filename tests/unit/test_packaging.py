"""What the distribution promises a user who installs or adopts it: a license
that is the one pyproject names, typed packages, project URLs into the
repository's layout, a changelog whose newest release is the package's version,
the demo in a package of its own that the daemon never imports (and whose
report does not import its runner), and a README under 12 KiB that says what
pacerd is, how to run it and how it compares. Files are parsed, not imported."""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path
from urllib.parse import urlsplit

import pytest

import pacerd

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PROJECT = PYPROJECT["project"]
DEMO = ROOT / "pacerd_demo"
README_LIMIT = 12 * 1024


# -- license, types, metadata --------------------------------------------------------


def test_the_license_file_is_the_license_pyproject_names() -> None:
    assert PROJECT["license"] == "Apache-2.0"
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text
    assert "Version 2.0, January 2004" in text


def test_every_shipped_package_is_typed() -> None:
    packages = PYPROJECT["tool"]["hatch"]["build"]["targets"]["wheel"]["packages"]
    assert set(packages) == {"pacerd", "pacerd_demo"}
    for package in packages:
        assert (ROOT / package / "py.typed").is_file(), package
    assert "Typing :: Typed" in PROJECT["classifiers"]
    assert set(packages) <= set(PYPROJECT["tool"]["mypy"]["files"])


def test_project_urls_point_into_the_repository_layout() -> None:
    urls = PROJECT["urls"]
    assert {"Homepage", "Documentation", "Changelog", "Issues"} <= set(urls)
    roots = set()
    for name, url in urls.items():
        parts = urlsplit(url)
        assert parts.scheme == "https", (name, url)
        owner_repo = "/".join(parts.path.strip("/").split("/")[:2])
        roots.add((parts.netloc, owner_repo))
        match = re.fullmatch(r"/[^/]+/[^/]+/(?:blob|tree)/main/(.+)", parts.path)
        if match:
            assert (ROOT / match.group(1)).exists(), (name, url)
    assert len(roots) == 1, roots  # one repository
    assert urls["Changelog"].endswith("/CHANGELOG.md")
    assert urls["Issues"].endswith("/issues")


# -- version and changelog -----------------------------------------------------------

SECTION = re.compile(r"^## (?P<version>\S+)(?: — (?P<date>.+))?$", re.MULTILINE)


def releases() -> list[tuple[str, str | None]]:
    """(version, date) of each section of CHANGELOG.md after ``Unreleased``, newest first."""
    sections = SECTION.finditer((ROOT / "CHANGELOG.md").read_text())
    return [(m["version"], m["date"]) for m in sections if m["version"] != "Unreleased"]


def test_the_newest_release_in_the_changelog_is_the_package_version() -> None:
    [(newest, date), *older] = releases()
    assert newest == pacerd.__version__
    assert re.fullmatch(r"\d+\.\d+\.\d+", newest), newest
    assert date is not None
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", date), date
    versions = [tuple(int(part) for part in v.split(".")) for v, _ in [(newest, date), *older]]
    assert versions == sorted(versions, reverse=True)
    assert len(set(versions)) == len(versions)


def test_the_version_is_read_from_the_package() -> None:
    assert PROJECT["dynamic"] == ["version"]
    assert PYPROJECT["tool"]["hatch"]["version"]["path"] == "pacerd/__init__.py"


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


# -- README --------------------------------------------------------------------------

README = (ROOT / "README.md").read_text()
FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)


def test_the_readme_is_under_12_kib() -> None:
    assert len(README.encode()) <= README_LIMIT


def test_the_readme_starts_with_the_two_commands_and_what_pacerd_is() -> None:
    first = FENCE.search(README)
    assert first is not None
    commands = [line.split("#")[0].split() for line in first.group(0).splitlines()[1:-1]]
    assert commands == [["bash", "scripts/demo.sh"], ["bash", "scripts/test.sh"]]
    for _, script in commands:
        assert (ROOT / script).is_file(), script
    intro = README[first.end() :].lstrip().split("\n\n")[0]
    assert intro.startswith("pacerd is ")


def test_the_readme_has_the_diagram_the_comparison_and_the_supported_versions() -> None:
    diagram = next(block for block in FENCE.findall(README) if "──" in block)
    stops = ["producer", "ledger", "pacerd", "ready queue", "worker", "outcomes"]
    at = 0
    for stop in stops:  # in this order, from top to bottom
        at = diagram.index(stop, at)
    compared = README.split("## Compared with", 1)[1].split("\n## ", 1)[0]
    for other in ("Celery", "PgQueuer", "Oban", "River", "Hatchet"):
        assert other in compared, other
    assert re.search(r"PostgreSQL \d+", README)
    assert re.search(r"RabbitMQ \d+\.\d+", README)


@pytest.mark.parametrize("term", ["live lane", "release slice", "epoch", "cut", "round trip"])
def test_each_term_is_defined_where_the_readme_first_uses_it(term: str) -> None:
    """Its first use outside code is in bold, the sentence that defines it."""
    prose = re.sub(r"`[^`\n]*`", "", FENCE.sub("", README))
    first = re.search(rf"(\*\*)?\b{re.escape(term)}", prose, re.IGNORECASE)
    assert first is not None, term
    assert first.group(1) == "**", prose[max(0, first.start() - 80) : first.end() + 40]
