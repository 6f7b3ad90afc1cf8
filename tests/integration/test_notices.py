"""The ledger's notices of pauses, resumes and cool-downs (migration 0006),
heard by ``ControlNotices`` on a real PostgreSQL; and a daemon that releases
a destination resumed mid-tick at once, not at its next tick."""

from __future__ import annotations

import time

import anyio
import asyncpg
import pytest
from dispatch_helpers import (
    WorkerPool,
    daemon_config,
    delete_queues,
    purge_outcomes,
    running_daemon,
    schedule_many,
    unique,
    worker_pool,
)

from pacerd import ledger
from pacerd.clock import SystemClock
from pacerd.notices import APPLICATION_NAME, ControlNotices, Notice, parse

pytestmark = [pytest.mark.services, pytest.mark.timeout(120)]


def test_a_notice_says_open_or_closed_and_which_destination() -> None:
    assert parse("open d") == (True, "d")
    assert parse("closed tenant-1") == (False, "tenant-1")
    assert parse("open *") == (True, None)
    for bad in ("", "open", "opened d", "closed "):
        assert parse(bad) is None


class _Heard:
    def __init__(self) -> None:
        self.notices: list[Notice] = []

    async def expect(self, *expected: Notice) -> None:
        """Waits until ``expected`` were heard, then checks nothing else was."""
        with anyio.fail_after(10):
            while len(self.notices) < len(expected):
                await anyio.sleep(0.01)
        await anyio.sleep(0.1)  # a notice that should not come has had its chance
        assert self.notices == list(expected)
        self.notices.clear()


async def test_every_change_of_a_pause_or_a_cool_down_is_noticed_once(db_dsn: str) -> None:
    heard = _Heard()
    notices = ControlNotices(db_dsn, clock=SystemClock(), on_notice=heard.notices.append)
    conn = await asyncpg.connect(db_dsn)
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(notices.run)
            await heard.expect((False, None))  # on connecting: read everything again
            await conn.execute("SELECT pacerd.pause('d')")  # creates the destination, paused
            await heard.expect((False, "d"))
            await conn.execute("SELECT pacerd.pause('d')")  # unchanged: no notice
            await conn.execute("SELECT pacerd.resume('d')")
            await heard.expect((True, "d"))
            await conn.execute("SELECT pacerd.pause(NULL)")
            await heard.expect((False, None))
            await conn.execute("SELECT pacerd.resume(NULL)")
            await heard.expect((True, None))

            await conn.execute(
                "SELECT pacerd.schedule(job_id => j, kind => 'k', destination => 'd',"
                " payload => '{}', eligible_at => now() - interval '1 minute')"
                " FROM unnest(ARRAY['a', 'b']) j"
            )
            await heard.expect()  # new work is no change of a pause or a cool-down
            led = await ledger.Ledger.connect(db_dsn, max_size=1)
            try:
                a, b = await led.claim_due(
                    "d", live_limit=0, limit=2, claim_seconds=30.0, epoch=0,
                    live_window_seconds=0.0, instance="test",
                )  # fmt: skip
            finally:
                await led.close()
            report = "SELECT pacerd.report($1, $2, 'refused', retry_after_s => $3)"
            await conn.execute(report, a.job_id, a.attempt, None)
            await heard.expect()  # a refusal without Retry-After changes neither
            await conn.execute(report, b.job_id, b.attempt, 30.0)
            await heard.expect((False, "d"))
            await conn.execute(  # an operator ends the cool-down by hand
                "UPDATE pacerd.destinations SET cooldown_until = now() - interval '1 second'"
            )
            await heard.expect((True, "d"))
            tg.cancel_scope.cancel()
    finally:
        await conn.close()


async def test_the_listening_session_is_opened_again_after_it_is_lost(db_dsn: str) -> None:
    heard = _Heard()
    notices = ControlNotices(db_dsn, clock=SystemClock(), on_notice=heard.notices.append)
    conn = await asyncpg.connect(db_dsn)
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(notices.run)
            await heard.expect((False, None))
            killed = await conn.fetchval(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
                " WHERE application_name = $1 AND datname = current_database()",
                APPLICATION_NAME,
            )
            assert killed == 1
            await heard.expect((False, None))  # listening again, and reading again
            await conn.execute("SELECT pacerd.pause('e')")
            await heard.expect((False, "e"))
            tg.cancel_scope.cancel()
    finally:
        await conn.close()


async def test_a_destination_resumed_mid_tick_is_released_before_its_next_tick(
    db_dsn: str, amqp_url: str
) -> None:
    tick = 10.0  # long: only a reopening claims before the next one
    name = unique("resumed")
    queue = f"pacerd.ready.{name}"
    await purge_outcomes(amqp_url)
    await schedule_many(db_dsn, name, 20, prefix=name)
    conn = await asyncpg.connect(db_dsn)
    await conn.execute("SELECT pacerd.pause($1)", name)
    cfg = daemon_config(
        db_dsn, amqp_url, pacing__tick_seconds=tick, pacing__initial_rate=5, pacing__max_rate=5
    )
    try:
        async with (
            running_daemon(cfg) as (_daemon, ticks),
            worker_pool(amqp_url, [queue], WorkerPool()),
        ):
            with anyio.fail_after(30):  # its first tick, paused
                while not any(t.destination == name for t in ticks.ticks):
                    await anyio.sleep(0.01)
            paused_tick_at = time.monotonic()
            (first,) = [t for t in ticks.ticks if t.destination == name]
            assert first.skipped == "paused"
            await conn.execute("SELECT pacerd.resume($1)", name)
            with anyio.fail_after(30):
                while not await conn.fetchval(
                    "SELECT count(*) FROM pacerd.jobs WHERE destination = $1"
                    " AND state <> 'scheduled'",
                    name,
                ):
                    await anyio.sleep(0.01)
            released_at = time.monotonic()
            # the next tick was due a tick after the paused one, or later
            assert released_at < paused_tick_at + tick, released_at - paused_tick_at
    finally:
        await conn.close()
        await delete_queues(amqp_url, [queue])
