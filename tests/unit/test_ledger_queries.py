"""``sql/queries.sql`` and the migrations as files: every named block parses,
names are unique and every block is sent, placeholders are numbered without
gaps. No database: the integration tests prepare and run them."""

from __future__ import annotations

import datetime as dt
import re
from importlib import resources

import pytest

from pacerd import ledger
from pacerd.client import Client, DeadFilter, dead_statement
from pacerd.leadership import LeaderLocks

QUERIES = ledger.load_queries()
TEXT = resources.files("pacerd.sql").joinpath("queries.sql").read_text(encoding="utf-8")
SENDERS = {
    module: resources.files("pacerd").joinpath(f"{module}.py").read_text(encoding="utf-8")
    for module in ("ledger", "leadership", "client")
}
EVERY_CONDITION = DeadFilter(
    destination="d", kind="k", error_contains="e", dead_since=dt.datetime.now(dt.UTC)
)


def rendered(name: str) -> str:
    """The block as sent: a template (``{where}``) filled with every condition
    a DeadFilter has (their placeholders after the block's own)."""
    sql = QUERIES[name].sql
    if "{where}" not in sql:
        return sql
    first = 1 + len(set(re.findall(r"\$(\d+)", sql)))
    return dead_statement(name, EVERY_CONDITION, first)[0]


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
    numbers = {int(n) for n in re.findall(r"\$(\d+)", rendered(name))}
    assert numbers == set(range(1, len(numbers) + 1)), (name, sorted(numbers))


@pytest.mark.parametrize("name", sorted(QUERIES))
def test_every_query_is_sent(name: str) -> None:
    """Every block is sent: by the async method of the same name (on ``Ledger``,
    on ``LeaderLocks`` for the statements of the leadership session, on
    ``Client`` for the producer's and operator's), or by name from the module
    that owns it (the migration runner's, a method's second statement)."""
    owners = (ledger.Ledger, LeaderLocks, Client)
    method = any(callable(getattr(o, name, None)) for o in owners)
    by_name = any(f'"{name}"' in source for source in SENDERS.values())
    assert method or by_name, f"{name} is sent by nobody"


def test_migrations_are_numbered_in_order() -> None:
    files = ledger.migration_files()
    assert files, "no migrations shipped"
    versions = [version for version, _, _ in files]
    assert versions == list(range(1, len(files) + 1))
    for _, name, sql in files:
        assert re.fullmatch(r"\d{4}_[a-z0-9_]+\.sql", name)
        assert sql.strip()
