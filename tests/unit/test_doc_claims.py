"""Every test the documentation cites as holding a guarantee exists: each node id
``tests/...py::test_name`` (or ``::Class::test_name``, optionally with a
``[param]``) in the README, the changelog and ``docs/`` names a function of that
file. The files are parsed, not imported, so a rename fails here at once."""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted([ROOT / "README.md", ROOT / "CHANGELOG.md", *(ROOT / "docs").glob("*.md")])
NODE_ID = re.compile(r"\b(tests/[\w/]+\.py)((?:::\w+)+)(?:\[[^\]\s`]*\])?")
TEST_FILE = re.compile(r"(?<![\w/])(tests/[\w/]+\.py)\b")
FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef)


@cache
def defined(path: Path) -> frozenset[str]:
    """The node ids a test file defines: ``name`` for its module-level
    functions, ``Class::name`` for the methods of its module-level classes."""
    names: set[str] = set()
    for node in ast.parse(path.read_text(), filename=str(path)).body:
        if isinstance(node, FUNCTIONS):
            names.add(node.name)
        elif isinstance(node, ast.ClassDef):
            names.update(
                f"{node.name}::{item.name}" for item in node.body if isinstance(item, FUNCTIONS)
            )
    return frozenset(names)


def missing(text: str) -> list[str]:
    """The node ids cited in ``text`` whose file or function does not exist."""
    problems: list[str] = []
    for match in NODE_ID.finditer(text):
        file_part, name = match.group(1), match.group(2).removeprefix("::")
        path = ROOT / file_part
        if not path.is_file():
            problems.append(f"{match.group(0)}: no such file")
        elif name not in defined(path):
            problems.append(f"{match.group(0)}: {file_part} defines no {name}")
    return problems


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_cited_test_exists(doc: Path) -> None:
    assert missing(doc.read_text()) == []


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_cited_test_file_exists(doc: Path) -> None:
    cited = {match.group(1) for match in TEST_FILE.finditer(doc.read_text())}
    assert sorted(name for name in cited if not (ROOT / name).is_file()) == []


def test_the_docs_cite_tests() -> None:
    cited = [m.group(0) for doc in DOCS for m in NODE_ID.finditer(doc.read_text())]
    assert len(cited) > 20


def test_a_renamed_or_moved_test_is_reported() -> None:
    here = "tests/unit/test_doc_claims.py"
    assert missing(f"`{here}::test_the_docs_cite_tests`") == []
    assert missing(f"`{here}::test_every_cited_test_exists[README.md]`") == []
    assert missing(f"`{here}::test_the_docs_cite_testz`") == [
        f"{here}::test_the_docs_cite_testz: {here} defines no test_the_docs_cite_testz"
    ]
    assert missing("`tests/unit/test_nowhere.py::test_x`") == [
        "tests/unit/test_nowhere.py::test_x: no such file"
    ]
    assert missing(f"{here}::Nothing::test_the_docs_cite_tests") != []


def test_methods_of_a_class_are_named_through_it(tmp_path: Path) -> None:
    source = tmp_path / "test_sample.py"
    source.write_text("class TestThing:\n    async def test_a(self): ...\n\ndef test_b(): ...\n")
    assert defined(source) == {"TestThing::test_a", "test_b"}
