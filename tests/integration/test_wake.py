"""Idle destinations cost nothing: the ledger's wake time (``wake_at``), set
when a leader parks a destination, lowered by whatever gives it work; and
partitions, stored with each destination."""

from __future__ import annotations

import anyio
import asyncpg
import pytest

from pacerd.ledger import Ledger

pytestmark = pytest.mark.services

ALL = list(range(64))


async def schedule(conn: asyncpg.Connection, job_id: str, destination: str, delay: float) -> None:
    await conn.fetchval(
        "SELECT pacerd.schedule($1, 'k', $2, '{}'::jsonb, now() + make_interval(secs => $3))",
        job_id, destination, delay,
    )  # fmt: skip


async def wake_at(conn: asyncpg.Connection, destination: str) -> object:
    return await conn.fetchval(
        "SELECT wake_at FROM pacerd.destinations WHERE destination = $1", destination
    )


async def woken(led: Ledger, destination: str) -> bool:
    return destination in {d for d, _ in await led.wake_destinations(ALL)}


async def test_parking_sets_the_next_job_time_and_scheduling_lowers_it(db_dsn: str) -> None:
    led = await Ledger.connect(db_dsn, max_size=2)
    conn = await asyncpg.connect(db_dsn)
    try:
        await schedule(conn, "later", "w1", 3600)
        assert await woken(led, "w1")  # new: looked at once
        assert await led.park_destinations(["w1"]) == {"w1"}
        later = await conn.fetchval(
            "SELECT next_attempt_at FROM pacerd.jobs WHERE job_id = 'later'"
        )
        assert await wake_at(conn, "w1") == later
        assert not await woken(led, "w1")
        await schedule(conn, "now", "w1", -1)
        assert await woken(led, "w1")
        assert await led.park_destinations(["w1"]) == set()  # something is due
        # a destination with nothing scheduled at all parks until it gets work
        await schedule(conn, "once", "w2", -1)
        await conn.execute("SELECT pacerd.cancel('once', 'test')")
        assert await led.park_destinations(["w2"]) == {"w2"}
        assert await wake_at(conn, "w2") is None
        assert await conn.fetchval(
            "SELECT partition = pacerd._partition_of(destination, 64)"
            " FROM pacerd.destinations WHERE destination = 'w2'"
        )
    finally:
        await conn.close()
        await led.close()


async def test_work_in_flight_or_a_cool_down_keeps_a_destination_awake(db_dsn: str) -> None:
    led = await Ledger.connect(db_dsn, max_size=2)
    conn = await asyncpg.connect(db_dsn)
    try:
        await schedule(conn, "a", "w3", -1)
        (job,) = await led.claim_due(
            "w3", live_limit=0, limit=10, claim_seconds=30, epoch=0, live_window_seconds=0,
            instance="t",
        )  # fmt: skip
        assert await led.park_destinations(["w3"]) == set()  # claimed: in flight
        await led.release_claims([job.ref], reason="test")
        await conn.execute("SELECT pacerd.cancel('a', 'test')")
        await conn.execute(
            "UPDATE pacerd.destinations SET cooldown_until = now() + interval '1 hour'"
            " WHERE destination = 'w3'"
        )
        assert await led.park_destinations(["w3"]) == set()
    finally:
        await conn.close()
        await led.close()


async def test_a_replay_and_a_revision_wake_a_parked_destination(db_dsn: str) -> None:
    led = await Ledger.connect(db_dsn, max_size=2)
    conn = await asyncpg.connect(db_dsn)
    try:
        await schedule(conn, "r", "w4", -1)
        await conn.execute("UPDATE pacerd.jobs SET state = 'dead' WHERE job_id = 'r'")
        assert await led.park_destinations(["w4"]) == {"w4"}
        assert not await woken(led, "w4")
        assert await conn.fetchval("SELECT pacerd.replay('r', 'test')") == "replayed"
        assert await woken(led, "w4")
        await conn.execute("SELECT pacerd.cancel('r', 'test')")
        await schedule(conn, "v", "w5", 3600)
        assert await led.park_destinations(["w5"]) == {"w5"}
        await conn.fetchval(
            "SELECT pacerd.schedule('v', 'k', 'w5', '{}'::jsonb, now() - interval '1 s', 1)"
        )
        assert await woken(led, "w5")
    finally:
        await conn.close()
        await led.close()


async def test_a_job_scheduled_while_a_park_runs_is_not_lost(db_dsn: str) -> None:
    """The producer's transaction is open when the leader parks: the park
    waits for it (the row lock), then sees its job, and does not park."""
    led = await Ledger.connect(db_dsn, max_size=2)
    setup = await asyncpg.connect(db_dsn)
    producer = await asyncpg.connect(db_dsn)
    try:
        await schedule(setup, "old", "w6", 3600)
        assert await led.park_destinations(["w6"]) == {"w6"}  # wake_at: an hour away
        await schedule(setup, "x", "w6", 7200)  # does not lower it: no lock taken
        tx = producer.transaction()
        await tx.start()
        await schedule(producer, "racing", "w6", 7200)  # later than wake_at: a share lock

        result: list[set[str]] = []
        async with anyio.create_task_group() as tg:

            async def park() -> None:
                result.append(await led.park_destinations(["w6"]))

            tg.start_soon(park)
            await anyio.sleep(0.3)
            assert not result, "the park did not wait for the producer's transaction"
            await schedule(producer, "due", "w6", -1)
            await tx.commit()
        assert result == [set()]  # the due job it waited for keeps it awake
        assert await woken(led, "w6")
    finally:
        await producer.close()
        await setup.close()
        await led.close()
