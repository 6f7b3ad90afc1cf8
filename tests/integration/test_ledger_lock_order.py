"""Statements that lock several jobs take them in one order, so that the
daemon's own statements never deadlock each other.

Marks (one per destination, in confirm order), releases and outcome batches
(from two consumers, in message order, with refusals that also lock the
destinations' counters), with a claim and a reconciler pass beside them, run
at once on separate connections, over the same jobs, in shuffled orders, for
many rounds. PostgreSQL's own count of
deadlocks in the test database must stay at zero, and no statement may fail.
"""

from __future__ import annotations

import asyncio
import random
from typing import TYPE_CHECKING

import asyncpg
import pytest
import structlog

from pacerd import ledger
from pacerd.errors import LedgerError
from pacerd.models import JobRef, Outcome, Report

if TYPE_CHECKING:
    import datetime as dt

pytestmark = pytest.mark.services

DESTINATIONS = ("lock-a", "lock-b")
JOBS_PER_DESTINATION = 30
ROUNDS = 60
SEED = 20261201


async def _deadlocks_counted(admin: asyncpg.Connection, database: str) -> int:
    """PostgreSQL's count of deadlocks in ``database``, once every session of
    it has ended (a backend flushes its statistics when it exits)."""
    while await admin.fetchval(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = $1 AND pid <> pg_backend_pid()",
        database,
    ):
        await asyncio.sleep(0.05)
    await admin.execute("SELECT pg_stat_clear_snapshot()")
    n: int = await admin.fetchval(
        "SELECT deadlocks FROM pg_stat_database WHERE datname = $1", database
    )
    return n


async def _reset(conn: asyncpg.Connection) -> dict[str, JobRef]:
    """Every job claimed again, at a new attempt, with a live lease."""
    rows = await conn.fetch(
        "UPDATE pacerd.jobs SET state = 'claimed', attempt = attempt + 1, failures = 0,"
        " lease_expires_at = now() + interval '1 hour', next_attempt_at = now(),"
        " claimed_by = 'test' RETURNING job_id, attempt"
    )
    return {r["job_id"]: JobRef(job_id=r["job_id"], attempt=r["attempt"]) for r in rows}


def _reports(rng: random.Random, refs: list[JobRef]) -> list[Report]:
    """An outcome batch in message order: mostly ok, some refusals (which lock
    the destination's counters), retries and continuations, and now and then
    a job reported twice (the batch's slow path), and in half the batches a
    report the SQL API rejects (the batch is then applied report by report)."""
    chosen = rng.sample(refs, k=len(refs) // 2)
    chosen += rng.sample(chosen, k=2)
    rng.shuffle(chosen)
    outcomes = [Outcome.OK] * 6 + [Outcome.REFUSED, Outcome.RETRY, Outcome.CONTINUE]
    reports = [
        Report(
            job_id=ref.job_id,
            attempt=ref.attempt,
            outcome=(outcome := rng.choice(outcomes)),
            retry_after_s=0.0 if outcome is Outcome.REFUSED and rng.random() < 0.5 else None,
        )
        for ref in chosen
    ]
    if rng.random() < 0.5:  # a report the SQL API rejects: the batch goes one by one
        reports.insert(
            rng.randrange(len(reports)),
            Report(job_id=chosen[0].job_id, attempt=0, outcome=Outcome.OK),
        )
    return reports


async def test_marks_releases_and_outcome_batches_never_deadlock(db_dsn: str) -> None:
    database = db_dsn.rsplit("/", 1)[1]
    admin = await asyncpg.connect(db_dsn)
    # Deadlocks are found within milliseconds instead of a second: the rounds
    # stay short, and the count below is what PostgreSQL itself detected.
    await admin.execute(f"ALTER DATABASE \"{database}\" SET deadlock_timeout = '10ms'")
    await admin.execute(
        "SELECT pacerd.schedule(job_id => d || '-' || lpad(g::text, 3, '0'), kind => 'k',"
        " destination => d, payload => '{}')"
        " FROM unnest($1::text[]) d, generate_series(1, $2::int) g",
        list(DESTINATIONS),
        JOBS_PER_DESTINATION,
    )
    led = await ledger.Ledger.connect(db_dsn, max_size=8)
    later: dt.datetime = await admin.fetchval("SELECT now() + interval '61 minutes'")
    rng = random.Random(SEED)
    failures: list[str] = []
    try:
        with structlog.testing.capture_logs() as events:
            for _ in range(ROUNDS):
                refs = await _reset(admin)
                everything = list(refs.values())

                async def mark(destination: str, refs: list[JobRef] = everything) -> None:
                    mine = [r for r in refs if r.job_id.startswith(destination)]
                    rng.shuffle(mine)  # publisher confirms arrive in any order
                    await led.mark_offered(mine, offer_seconds=60.0)

                async def release(refs: list[JobRef] = everything) -> None:
                    await led.release_claims(rng.sample(refs, k=len(refs) // 4), reason="nack")

                async def report(refs: list[JobRef] = everything) -> None:
                    await led.apply_reports(_reports(rng, refs))

                async def claim() -> None:  # what the releases gave back
                    await led.claim_due(
                        rng.choice(DESTINATIONS), live_limit=5, limit=10, claim_seconds=60.0,
                        epoch=0, live_window_seconds=600.0, instance="test",
                    )  # fmt: skip

                async def reclaim() -> None:  # a reconciler whose clock is an hour ahead
                    await led.reclaim_expired(limit=10, now=later)

                results = await asyncio.gather(
                    mark(DESTINATIONS[0]),
                    report(),
                    claim(),
                    mark(DESTINATIONS[1]),
                    report(),
                    release(),
                    reclaim(),
                    return_exceptions=True,
                )
                for result in results:
                    if isinstance(result, LedgerError):
                        failures.append(str(result))
                    elif isinstance(result, BaseException):
                        raise result
    finally:
        await led.close()
    retried = [e for e in events if e.get("event") == "ledger_retried"]
    deadlocks = await _deadlocks_counted(admin, database)
    await admin.close()
    print(
        f"deadlocks detected by PostgreSQL: {deadlocks}; statements retried: {len(retried)};"
        f" statements failed: {len(failures)}"
    )
    assert failures == []
    assert retried == []
    assert deadlocks == 0


async def _blocked_by(admin: asyncpg.Connection, pid: int) -> int:
    """The backend that waits for a lock ``pid`` holds (polls until one does)."""
    while True:
        waiting = await admin.fetchval(
            "SELECT pid FROM pg_stat_activity WHERE $1 = ANY (pg_blocking_pids(pid))", pid
        )
        if waiting is not None:
            return int(waiting)
        await asyncio.sleep(0.01)


async def test_a_deadlock_victim_is_retried_once_and_succeeds(db_dsn: str) -> None:
    """A real deadlock whose victim is the ledger's mark: the mark is run once
    more, waits its turn, and marks every job; the retry is logged.

    Another client (``holder``) locks job c, then job a; a third (``gate``)
    holds b until the mark has locked a and waits for b. When ``gate`` lets b
    go, the mark asks for c and closes the cycle; the mark is the session with
    the short deadlock timeout, so it is the one PostgreSQL aborts."""
    database = db_dsn.rsplit("/", 1)[1]
    admin = await asyncpg.connect(db_dsn)
    await admin.execute(f"ALTER DATABASE \"{database}\" SET deadlock_timeout = '10ms'")
    await admin.execute(
        "SELECT pacerd.schedule(job_id => j, kind => 'k', destination => 'd', payload => '{}')"
        " FROM unnest(ARRAY['a', 'b', 'c']) j"
    )
    refs = list((await _reset(admin)).values())
    holder = await asyncpg.connect(db_dsn)
    gate = await asyncpg.connect(db_dsn)
    led = await ledger.Ledger.connect(db_dsn, max_size=1)
    lock_one = "SELECT job_id FROM pacerd.jobs WHERE job_id = $1 FOR UPDATE"
    try:
        for conn in (holder, gate):
            await conn.execute("SET deadlock_timeout = '10min'")
            await conn.execute("BEGIN")
        await holder.fetch(lock_one, "c")
        await gate.fetch(lock_one, "b")
        with structlog.testing.capture_logs() as events:
            mark = asyncio.create_task(led.mark_offered(refs, offer_seconds=60.0))
            marker = await _blocked_by(admin, gate.get_server_pid())  # holds a, waits for b
            # Next in line for the pool's one connection: the retry waits until
            # ``holder`` has a and has committed (else the retry could lock a
            # first, and deadlock with ``holder`` once more).
            turn = asyncio.ensure_future(led.pool.acquire())
            holding_a = asyncio.create_task(holder.fetch(lock_one, "a"))
            assert await _blocked_by(admin, marker) == holder.get_server_pid()
            await gate.execute("COMMIT")  # the mark takes b, then waits for c: a cycle
            assert [r["job_id"] for r in await holding_a] == ["a"]  # the mark was the victim
            await holder.execute("COMMIT")
            await led.pool.release(await turn)
            marked = await mark
    finally:
        await led.close()
        await holder.close()
        await gate.close()
    retried = [e for e in events if e.get("event") == "ledger_retried"]
    deadlocks = await _deadlocks_counted(admin, database)
    await admin.close()
    assert sorted(marked, key=lambda r: r.job_id) == sorted(refs, key=lambda r: r.job_id)
    assert [(e["query"], e["sqlstate"]) for e in retried] == [("mark_offered", "40P01")]
    assert deadlocks == 1
