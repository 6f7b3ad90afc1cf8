"""The worker's batched ``pacerd.is_current`` (``pacerd.currency.CurrentCheck``)
against PostgreSQL: the checks asked together go as one statement, each offer
gets its own answer, and without the database every offer is current (fail open)."""

from __future__ import annotations

import asyncio
import uuid
from typing import TYPE_CHECKING

import anyio

from pacerd import currency
from pacerd import worker as worker_module
from pacerd.client import Client
from pacerd.clock import ManualClock, SystemClock
from pacerd.currency import CurrentCheck
from pacerd.ledger import Ledger
from pacerd.worker import Job, Worker, WorkerApp

if TYPE_CHECKING:
    import pytest

NO_DATABASE = "postgresql://postgres@127.0.0.1:1/nowhere"  # nothing listens on port 1


async def claimed(ledger: Ledger, destination: str, n: int) -> dict[str, int]:
    """``n`` jobs of ``destination``, claimed: job id -> its current attempt."""
    client = Client(ledger.pool)
    for i in range(n):
        await client.schedule(f"{destination}-{i}", kind="k", destination=destination, payload={})
    jobs = await ledger.claim_due(
        destination, live_limit=0, limit=n, claim_seconds=30.0, epoch=0,
        live_window_seconds=60.0, instance="test",
    )  # fmt: skip
    assert len(jobs) == n
    return {j.job_id: j.attempt for j in jobs}


async def test_checks_asked_together_go_as_one_statement_each_answered(db_dsn: str) -> None:
    ledger = await Ledger.connect(db_dsn, max_size=2)
    check = CurrentCheck(db_dsn, SystemClock())
    try:
        destination = f"cur-{uuid.uuid4().hex[:8]}"
        attempts = await claimed(ledger, destination, 6)
        stale = f"{destination}-2"
        assert await Client(ledger.pool).cancel(stale, "test") == "cancelled"
        asked = [(job_id, attempt) for job_id, attempt in sorted(attempts.items())]
        asked += [(f"{destination}-0", attempts[f"{destination}-0"] + 1), ("no-such-job", 1)]
        with anyio.fail_after(10):
            answers = await asyncio.gather(*(check.is_current(j, a) for j, a in asked))
        assert check.statements == 1
        expected = [j != stale for j, _ in asked[:6]] + [False, False]
        assert answers == expected
        with anyio.fail_after(10):  # asked later: the next statement
            assert await check.is_current(f"{destination}-1", attempts[f"{destination}-1"])
        assert check.statements == 2
    finally:
        await check.close()
        await ledger.close()


async def test_without_the_database_every_offer_is_current() -> None:
    clock = ManualClock()
    check = CurrentCheck(NO_DATABASE, clock)
    try:
        with anyio.fail_after(30):
            answers = await asyncio.gather(*(check.is_current(f"j-{i}", 1) for i in range(5)))
            assert answers == [True] * 5
            assert await check.is_current("j-9", 1)  # within the retry pause: no new attempt
        assert check.statements == 0
    finally:
        await check.close()


async def test_a_failing_statement_fails_open(db_dsn: str) -> None:
    """A database without pacerd's schema: the statement fails, the offers run."""
    admin = db_dsn.rsplit("/", 1)[0] + "/postgres"
    check = CurrentCheck(admin, SystemClock())
    try:
        with anyio.fail_after(30):
            answers = await asyncio.gather(check.is_current("a", 1), check.is_current("b", 2))
        assert list(answers) == [True, True]
        assert check.statements == 1
    finally:
        await check.close()


async def test_the_worker_runs_its_handlers_when_the_database_is_down() -> None:
    """``check_current`` on, the database unreachable: ``process`` runs the handler."""
    app = WorkerApp(destinations=["llm"], check_current=True)
    ran: list[str] = []

    @app.handler()
    async def handle(job: Job) -> None:
        ran.append(job.job_id)

    worker = Worker(app, broker_url="amqp://unused", dsn=NO_DATABASE)
    ready = (
        '{"job_id": "j-%d", "kind": "k", "destination": "llm", "attempt": 1, "revision": 0,'
        ' "payload": {}, "cursor": null, "eligible_at": "2026-01-02T03:04:05+00:00"}'
    )
    try:
        with anyio.fail_after(30):
            outs = await asyncio.gather(
                *(worker.process("llm", (ready % i).encode()) for i in range(3))
            )
        assert [o is not None and o.outcome for o in outs] == ["ok"] * 3
        assert sorted(ran) == ["j-0", "j-1", "j-2"]
    finally:
        assert worker.current_check is not None
        await worker.current_check.close()


async def test_the_checks_pool_leaves_sessions_as_they_are(db_dsn: str) -> None:
    """``CurrentCheck``'s statements go back to the pool without asyncpg's
    reset (a round trip and four statements each); a default pool still resets."""
    for stateless, kept in ((True, "kept"), (False, "")):
        client = await Client.connect(db_dsn, max_size=1, stateless=stateless)
        try:
            async with client.pool.acquire() as conn:
                await conn.execute("SET application_name = 'kept'")
            async with client.pool.acquire() as conn:
                assert await conn.fetchval("SHOW application_name") == kept
        finally:
            await client.close()
    check = CurrentCheck(db_dsn, SystemClock())
    try:
        with anyio.fail_after(10):
            assert not await check.is_current("no-such-job", 1)
        assert check._client is not None
        async with check._client.pool.acquire() as conn:
            await conn.execute("SET application_name = 'kept'")
        async with check._client.pool.acquire() as conn:
            assert await conn.fetchval("SHOW application_name") == "kept"
    finally:
        await check.close()


async def test_a_busy_workers_checks_are_spaced_and_gather(
    db_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A statement starts ``MIN_INTERVAL_SECONDS`` after the one before at the
    earliest: the checks asked one by one meanwhile go as one statement, each
    answered; an idle worker's check (the last statement long ago) goes at once.
    (The interval is widened here so that a slow statement cannot outlast it.)"""
    interval = 0.3
    monkeypatch.setattr(currency, "MIN_INTERVAL_SECONDS", interval)
    ledger = await Ledger.connect(db_dsn, max_size=2)
    check = CurrentCheck(db_dsn, SystemClock())
    loop = asyncio.get_running_loop()
    try:
        destination = f"cur-{uuid.uuid4().hex[:8]}"
        attempts = await claimed(ledger, destination, 4)
        asked = sorted(attempts.items())
        with anyio.fail_after(10):
            assert not await check.is_current("no-such-job", 1)  # connected
        await asyncio.sleep(interval * 1.2)
        with anyio.fail_after(10):
            idle = loop.time()
            assert await check.is_current(*asked[0])  # idle: at once
            assert loop.time() - idle < interval * 0.8
            waiting = []
            for job_id, attempt in asked[1:]:  # one by one, each in a later turn
                waiting.append(asyncio.ensure_future(check.is_current(job_id, attempt)))
                await asyncio.sleep(0.001)
            assert await asyncio.gather(*waiting) == [True] * 3
            assert loop.time() - idle >= interval * 0.9
        assert check.statements == 3
    finally:
        await check.close()
        await ledger.close()


async def test_a_redelivered_offer_is_checked_once_its_earlier_outcome_had_time_to_land(
    db_dsn: str,
) -> None:
    """A redelivered offer may have been reported already (the worker that
    held it died between its outcome's confirm and the acknowledgement): its
    check waits ``REDELIVERED_CHECK_DELAY_SECONDS``, so that the outcome
    applied meanwhile makes it not current and the handler does not run. A
    first delivery is checked, and run, at once."""
    destination = f"cur-{uuid.uuid4().hex[:8]}"
    ledger = await Ledger.connect(db_dsn, max_size=2)
    clock = ManualClock()
    app = WorkerApp(destinations=[destination], check_current=True)
    ran: list[str] = []

    @app.handler()
    async def handle(job: Job) -> None:
        ran.append(job.job_id)

    worker = Worker(app, broker_url="amqp://unused", dsn=db_dsn, clock=clock)
    try:
        attempts = await claimed(ledger, destination, 2)
        first, again = sorted(attempts)

        def offer(job_id: str) -> bytes:
            return (
                f'{{"job_id": "{job_id}", "kind": "k", "destination": "{destination}",'
                f' "attempt": {attempts[job_id]}, "revision": 0, "payload": {{}},'
                ' "cursor": null, "eligible_at": "2026-01-02T03:04:05+00:00"}'
            ).encode()

        with anyio.fail_after(10):  # the clock stands still: checked and run at once
            out = await worker.process(destination, offer(first))
        assert out is not None
        assert ran == [first]

        redelivered = asyncio.ensure_future(
            worker.process(destination, offer(again), redelivered=True)
        )
        await asyncio.sleep(0.1)
        assert not redelivered.done()  # waiting, on the worker's clock
        # the outcome its earlier holder published lands meanwhile
        assert await Client(ledger.pool).report(again, attempts[again], "ok") == "applied"
        clock.advance(worker_module.REDELIVERED_CHECK_DELAY_SECONDS)
        with anyio.fail_after(10):
            assert await redelivered is None  # not current: acknowledged, not run
        assert ran == [first]
    finally:
        assert worker.current_check is not None
        await worker.current_check.close()
        await ledger.close()
