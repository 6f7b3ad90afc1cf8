"""Shared fixtures.

Integration tests use the real PostgreSQL and RabbitMQ (never mocks): a
migrated template database is built once per session, and each test that needs
commits or several connections gets a fresh clone of it.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator, Iterator
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import pytest

from pacerd import ledger

ADMIN_DSN = os.environ.get("PACERD_TEST_DSN", "postgresql://postgres@127.0.0.1:5432/postgres")
AMQP_URL = os.environ.get("PACERD_TEST_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")
TEMPLATE = f"pacerd_template_{os.getpid()}"


def dsn_for(database: str) -> str:
    parts = urlsplit(ADMIN_DSN)
    return urlunsplit(parts._replace(path=f"/{database}"))


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in list(os.environ):
        if key.startswith("PACERD_") and not key.startswith("PACERD_TEST_"):
            monkeypatch.delenv(key)


async def _admin(sql: str) -> None:
    conn = await asyncpg.connect(ADMIN_DSN)
    try:
        await conn.execute(sql)
    finally:
        await conn.close()


@pytest.fixture(scope="session")
async def template_db() -> AsyncIterator[str]:
    await _admin(f'DROP DATABASE IF EXISTS "{TEMPLATE}" WITH (FORCE)')
    await _admin(f'CREATE DATABASE "{TEMPLATE}"')
    await ledger.migrate(dsn_for(TEMPLATE))
    yield TEMPLATE
    await _admin(f'DROP DATABASE IF EXISTS "{TEMPLATE}" WITH (FORCE)')


@pytest.fixture
async def db_dsn(template_db: str) -> AsyncIterator[str]:
    """A fresh, migrated database for one test; dropped afterwards."""
    name = f"pacerd_t_{uuid.uuid4().hex[:12]}"
    await _admin(f'CREATE DATABASE "{name}" TEMPLATE "{template_db}"')
    yield dsn_for(name)
    await _admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
async def empty_db_dsn() -> AsyncIterator[str]:
    """A fresh database with nothing in it (for migration tests)."""
    name = f"pacerd_e_{uuid.uuid4().hex[:12]}"
    await _admin(f'CREATE DATABASE "{name}"')
    yield dsn_for(name)
    await _admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
async def ledger_(db_dsn: str) -> AsyncIterator[ledger.Ledger]:
    led = await ledger.Ledger.connect(db_dsn, max_size=6)
    yield led
    await led.close()


@pytest.fixture
def amqp_url() -> Iterator[str]:
    yield AMQP_URL
