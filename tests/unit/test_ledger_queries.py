"""``sql/queries.sql`` and the migrations as files: every named block parses,
names are unique and match a ``Ledger`` method, placeholders are numbered
without gaps. No database: the integration tests prepare and run them."""

from __future__ import annotations

import re
from importlib import resources

import pytest

from pacerd import ledger

QUERIES = ledger.load_queries()
TEXT = resources.files("pacerd.sql").joinpath("queries.sql").read_text(encoding="utf-8")


def test_every_block_is_loaded_once() -> None:
    names = re.findall(r"^-- name: (\S+)\s*$", TEXT, flags=re.MULTILINE)
    assert names, "no named blocks?"
    assert len(names) == len(set(names)), f"a name is used twice: {names}"
    assert sorted(names) == sorted(QUERIES)


@pytest.mark.parametrize("name", sorted(QUERIES))
def test_block_has_a_description_and_a_statement(name: str) -> None:
    query = QUERIES[name]
    assert query.name == name
    assert query.description, f"{name}: no one-line description"
    assert not query.description.startswith("--")
    assert "\n" not in query.description
    assert query.sql
    assert not query.sql.startswith("--"), f"{name}: the statement starts with a comment"
    assert "-- name:" not in query.sql


@pytest.mark.parametrize("name", sorted(QUERIES))
def test_placeholders_are_numbered_without_gaps(name: str) -> None:
    numbers = {int(n) for n in re.findall(r"\$(\d+)", QUERIES[name].sql)}
    assert numbers == set(range(1, len(numbers) + 1)), (name, sorted(numbers))


@pytest.mark.parametrize("name", sorted(QUERIES))
def test_every_query_has_its_ledger_method(name: str) -> None:
    """One async method of Ledger per named query, with the same name."""
    assert callable(getattr(ledger.Ledger, name, None)), f"Ledger.{name} is missing"


def test_migrations_are_numbered_in_order() -> None:
    files = ledger.migration_files()
    assert files, "no migrations shipped"
    versions = [version for version, _, _ in files]
    assert versions == list(range(1, len(files) + 1))
    for _, name, sql in files:
        assert re.fullmatch(r"\d{4}_[a-z0-9_]+\.sql", name)
        assert sql.strip()
