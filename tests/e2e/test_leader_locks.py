"""Leadership locks against the real PostgreSQL: the lock session's end is
seen at once, a stalled session's lease lapses before the server would free
its locks, a lock is never taken twice, and only this ledger's instances
count toward the fair share."""

from __future__ import annotations

from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import anyio
import asyncpg
import pytest
from support.proxy import FaultProxy
from support.services import with_port

from pacerd.clock import SystemClock
from pacerd.leadership import LeaderLocks, partition_lock

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

pytestmark = [pytest.mark.services, pytest.mark.timeout(60)]
P = partition_lock(0)  # a lock by a name the daemon takes: a partition's


@pytest.fixture
async def locks(db_dsn: str) -> AsyncIterator[list[LeaderLocks]]:
    made: list[LeaderLocks] = []
    yield made
    for lock in made:
        await lock.close()


async def _connected(
    made: list[LeaderLocks], dsn: str, name: str, *, lease_seconds: float = 5.0
) -> LeaderLocks:
    lock = LeaderLocks(dsn, instance=name, lease_seconds=lease_seconds)
    await lock.connect()
    made.append(lock)
    return lock


async def _terminate(dsn: str, pid: int) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        assert await conn.fetchval("SELECT pg_terminate_backend($1)", pid)
    finally:
        await conn.close()


async def test_a_terminated_lock_session_drops_leadership_at_once(
    db_dsn: str, locks: list[LeaderLocks]
) -> None:
    # A lease of an hour: nothing renews or probes the session while the test
    # waits, so only asyncpg's termination listener can report the loss.
    a = await _connected(locks, db_dsn, "a", lease_seconds=3600.0)
    b = await _connected(locks, db_dsn, "b")
    assert await a.try_acquire(P, settle_seconds=0.0)
    assert not await b.try_acquire(P)
    assert a.holds(P)
    assert a.usable_at(P) is not None
    changed = a.changed()
    pid = a.backend_pid
    assert pid is not None
    await _terminate(db_dsn, pid)
    with anyio.fail_after(30):
        await changed.wait()  # set by the termination listener: no probe is running
    assert not a.holds(P)
    assert a.held == frozenset()
    assert a.usable_at(P) is None
    with anyio.fail_after(5):
        await a.wait_lost(P)  # returns at once: nothing is held
    assert not await a.alive()
    clock = SystemClock()
    with anyio.fail_after(5):
        while True:
            asked = clock.monotonic()
            if await b.try_acquire(P, settle_seconds=0.5):
                break
            await anyio.sleep(0.01)
    # A new leader waits its settle time (from when it took the lock) before admitting.
    usable_at = b.usable_at(P)
    assert usable_at is not None
    assert usable_at >= asked + 0.5


async def session_setting(locks: LeaderLocks, name: str) -> str:
    """A setting of the lock session itself, as its server sees it."""
    conn = locks._conn
    assert conn is not None
    return str(await conn.fetchval(f"SHOW {name}"))


async def test_a_stalled_session_lapses_before_the_server_would_free_its_locks(
    db_dsn: str, locks: list[LeaderLocks]
) -> None:
    parts = urlsplit(db_dsn)
    proxy = FaultProxy(parts.port or 5432, target_host=parts.hostname or "127.0.0.1")
    await proxy.start()
    try:
        via = with_port(db_dsn, proxy.port)
        lease = 2.0
        a = await _connected(locks, via, "a", lease_seconds=lease)
        b = await _connected(locks, db_dsn, "b")
        assert await a.try_acquire(P)
        # The session's keepalives end it server-side after 2 x lease of silence.
        assert await session_setting(a, "tcp_keepalives_idle") == "2"
        assert await session_setting(a, "tcp_keepalives_count") == "2"
        assert await session_setting(a, "tcp_user_timeout") == "4000"
        proxy.partition()
        # The lease (1 x lease after the last answered probe) lapses before the
        # server would end the silent session (2 x lease): that is the bound.
        with anyio.fail_after(2 * lease):
            await a.wait_lost(P)  # renewing meanwhile: the probe times out
        assert not a.holds(P)
        # The server still holds the lock (the proxy keeps the socket open)...
        assert not await b.try_acquire(P)
        # ...until the connection is reset, as keepalives would.
        proxy.reset()  # the partition goes on: the lock can only have been freed by the server
        with anyio.fail_after(5):
            while not await b.try_acquire(P):
                await anyio.sleep(0.01)
    finally:
        await proxy.close()


async def test_a_lock_is_never_taken_twice_and_a_handover_unlocks_it(
    db_dsn: str, locks: list[LeaderLocks]
) -> None:
    a = await _connected(locks, db_dsn, "a")
    b = await _connected(locks, db_dsn, "b")
    assert await a.try_acquire(P)
    assert await a.try_acquire(P)  # already ours: not locked a second time
    a.begin_release(P)
    assert a.releasing(P)
    assert a.has_lock(P)
    assert not a.holds(P)
    assert not await a.try_acquire(P)  # being handed over
    assert not await b.try_acquire(P)
    await a.release(P)
    assert not a.has_lock(P)
    assert await b.try_acquire(P)  # one unlock freed it: it was locked once


async def test_only_this_ledgers_instances_count(
    db_dsn: str, empty_db_dsn: str, locks: list[LeaderLocks]
) -> None:
    a = await _connected(locks, db_dsn, "a")
    await _connected(locks, db_dsn, "b")
    other = await _connected(locks, empty_db_dsn, "elsewhere")
    assert await a.count_instances() == 2
    assert await other.count_instances() == 1
