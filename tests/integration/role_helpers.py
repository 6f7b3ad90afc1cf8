"""Test identities: login roles that act as a producer, a worker or an
operator, and virtual hosts of a test's own.

The three pacerd roles are NOLOGIN (``pacerd migrate`` creates them); a test
makes a LOGIN role that is a member of one, connects as it, and drops it
afterwards. Roles are cluster-wide, so every name is unique to the test.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import uuid
from typing import TYPE_CHECKING
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import pytest

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Iterator

AMQP_URL = "amqp://guest:guest@127.0.0.1:5672/"
ADMIN_DSN = os.environ.get("PACERD_TEST_DSN", "postgresql://postgres@127.0.0.1:5432/postgres")


def dsn_for(database: str) -> str:
    return urlunsplit(urlsplit(ADMIN_DSN)._replace(path=f"/{database}"))


def dsn_as(dsn: str, user: str) -> str:
    """``dsn`` with another user (the local cluster trusts 127.0.0.1)."""
    parts = urlsplit(dsn)
    host = parts.hostname or "127.0.0.1"
    port = f":{parts.port}" if parts.port else ""
    return urlunsplit(parts._replace(netloc=f"{user}@{host}{port}"))


def unique_role(prefix: str = "pacerd_t") -> str:
    return f"{prefix}_{uuid.uuid4().hex[:10]}"


async def admin(sql: str, *args: object) -> None:
    conn = await asyncpg.connect(ADMIN_DSN)
    try:
        await conn.execute(sql, *args)
    finally:
        await conn.close()


@contextlib.asynccontextmanager
async def login_role(*member_of: str) -> AsyncIterator[str]:
    """A LOGIN role that is a member of ``member_of`` (none: no rights at all)."""
    name = unique_role("pacerd_login")
    grant = f" IN ROLE {', '.join(member_of)}" if member_of else ""
    await admin(f"CREATE ROLE {name} LOGIN{grant}")
    try:
        yield name
    finally:
        await admin(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = $1", name
        )
        await admin(f"DROP ROLE IF EXISTS {name}")


def rabbitmqctl(*args: str) -> None:
    subprocess.run(["rabbitmqctl", "-q", *args], capture_output=True, timeout=60, check=True)


@contextlib.contextmanager
def private_vhost() -> Iterator[str]:
    """A virtual host of the test's own, for guest; yields its AMQP URL."""
    if shutil.which("rabbitmqctl") is None:
        pytest.skip("rabbitmqctl is needed to create a virtual host")
    name = f"pacerd-t-{uuid.uuid4().hex[:10]}"
    rabbitmqctl("add_vhost", name)
    try:
        rabbitmqctl("set_permissions", "-p", name, "guest", ".*", ".*", ".*")
        yield urlunsplit(urlsplit(AMQP_URL)._replace(path=f"/{name}"))
    finally:
        rabbitmqctl("delete_vhost", name)
