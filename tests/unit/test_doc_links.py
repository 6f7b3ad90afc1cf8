"""Every relative link in the documentation names a file that exists, and every
``#anchor`` a heading of that file (GitHub's slugs); every document the code
cites exists too."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted(
    [
        ROOT / "README.md",
        ROOT / "CHANGELOG.md",
        *(ROOT / "docs").glob("*.md"),
        *(ROOT / "examples").glob("*/README.md"),
    ]
)
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
DEFINITION = re.compile(r"^ {0,3}\[([^\]]+)\]:\s*(\S+)", re.MULTILINE)
REFERENCE = re.compile(r"(?<!!)\[[^\]]+\]\[([^\]]+)\]")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
CODE = re.compile(r"`[^`\n]*`")


def slug(heading: str) -> str:
    text = re.sub(r"`([^`]*)`", r"\1", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found: set[str] = set()
    for line in FENCE.sub("", path.read_text()).splitlines():
        match = re.match(r"^#{1,6}\s+(.*)$", line)
        if match:
            base = slug(match.group(1))
            name, n = base, 0
            while name in found:
                n += 1
                name = f"{base}-{n}"
            found.add(name)
    return found


def links(path: Path) -> list[str]:
    """Inline link targets, and those of reference definitions ``[name]: target``."""
    text = FENCE.sub("", path.read_text())
    return LINK.findall(text) + [target for _, target in DEFINITION.findall(text)]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc: Path) -> None:
    broken: list[str] = []
    for target in links(doc):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):
            continue  # https:, mailto:
        file_part, _, anchor = target.partition("#")
        linked = (doc.parent / file_part).resolve() if file_part else doc
        if not linked.exists():
            broken.append(f"{target}: no such file")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(f"{target}: no heading #{anchor}")
    assert broken == []


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_reference_links_are_defined(doc: Path) -> None:
    text = CODE.sub("", FENCE.sub("", doc.read_text()))
    defined = {name.lower() for name, _ in DEFINITION.findall(text)}
    assert sorted({n for n in REFERENCE.findall(text) if n.lower() not in defined}) == []


def test_slugs_follow_github() -> None:
    assert slug("The pacer, tick by tick") == "the-pacer-tick-by-tick"
    assert slug("Roles — not yet implemented") == "roles--not-yet-implemented"
    assert slug("`pacerd.tick` spans") == "pacerdtick-spans"


CODE_DIRS = ("pacerd", "pacerd_demo", "tests", "scripts", "bench", "examples", "deploy", "systemd")
CODE_SUFFIXES = {".py", ".sh", ".sql", ".js", ".mjs", ".toml", ".yaml", ".yml", ".service"}
MD_NAME = re.compile(r"(?<![\w/.*-])((?:\.\./|[\w-]+/)*[\w-]+\.md)\b")
MD_WRITTEN = {"results.md"}  # a file bench/faults/run.py writes, not one it cites


def code_files() -> list[Path]:
    files = [ROOT / "Dockerfile", ROOT / "compose.yaml", ROOT / "pyproject.toml"]
    for directory in CODE_DIRS:
        files += [
            p for p in (ROOT / directory).rglob("*")
            if p.suffix in CODE_SUFFIXES and "node_modules" not in p.parts
        ]  # fmt: skip
    return sorted(files)


def test_documents_the_code_cites_exist() -> None:
    """A ``*.md`` named in code, a comment or a docstring is a file of the
    repository (from its root or from the citing file), and nothing cites notes
    that were never checked in."""
    unknown: list[str] = []
    for path in code_files():
        text = path.read_text(errors="replace")
        where = str(path.relative_to(ROOT))
        for name in MD_NAME.findall(text):
            if name in MD_WRITTEN:
                continue
            if not ((ROOT / name).exists() or (path.parent / name).exists()):
                unknown.append(f"{where}: {name}")
        if path != Path(__file__).resolve() and re.search(r"field[ -]notes", text, re.I):
            unknown.append(f"{where}: the field notes")
    assert unknown == []
