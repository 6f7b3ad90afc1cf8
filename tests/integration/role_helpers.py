"""Test identities: login roles that act as a producer, a worker or an
operator, and virtual hosts of a test's own.

The three pacerd roles are NOLOGIN (``pacerd migrate`` creates them); a test
makes a LOGIN role that is a member of one, connects as it, and drops it
afterwards. Roles are cluster-wide, so every name is unique to the test.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import uuid
from typing import TYPE_CHECKING

import asyncpg
import pytest
from support.services import ADMIN_DSN, amqp_url_for

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Iterator


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
        yield amqp_url_for(name)
    finally:
        rabbitmqctl("delete_vhost", name)
