"""Several claimers on separate connections, committing for real, never claim
one row twice: ``FOR UPDATE SKIP LOCKED`` makes the claim safe to run from
every pacerd instance at once."""

from __future__ import annotations

import asyncio
import collections
import datetime as dt
from typing import TYPE_CHECKING

import asyncpg
import pytest

from pacerd import ledger

if TYPE_CHECKING:
    from pacerd.models import ClaimedJob

pytestmark = pytest.mark.services

ROWS = 5_000
CLAIMERS = 8
BATCH = 50
LIVE_WINDOW_SECONDS = 600.0


async def _claimer(
    led: ledger.Ledger, destination: str, name: str, now: dt.datetime, start: asyncio.Event
) -> list[ClaimedJob]:
    await start.wait()
    mine: list[ClaimedJob] = []
    while True:
        got = await led.claim_due(
            destination,
            live_limit=BATCH // 5,
            limit=BATCH,
            claim_seconds=60.0,
            epoch=0,
            live_window_seconds=LIVE_WINDOW_SECONDS,
            instance=name,
            now=now,
        )
        mine.extend(got)
        if not got and await led.has_due(destination, now=now) == 0:
            return mine
        await asyncio.sleep(0)  # every claimer gets its turn


async def test_concurrent_claimers_claim_every_due_row_exactly_once(db_dsn: str) -> None:
    led = await ledger.Ledger.connect(db_dsn, max_size=CLAIMERS)
    try:
        now = dt.datetime.now(dt.UTC)
        async with led.transaction() as conn:
            # Half the rows are overdue first attempts (backlog), half became due
            # within the live window (live): both lanes are contended.
            await conn.execute(
                "SELECT pacerd.schedule(job_id => 'job-' || g, kind => 'k', destination => 'd',"
                " payload => '{}',"
                " eligible_at => $1::timestamptz - make_interval(secs => g % 1200))"
                " FROM generate_series(1, $2::int) g",
                now,
                ROWS,
            )
            # Work that must never be claimed: another destination, the future.
            await conn.execute(
                "SELECT pacerd.schedule(job_id => 'other-' || g, kind => 'k', destination => 'e',"
                " payload => '{}', eligible_at => $1) FROM generate_series(1, 100) g",
                now,
            )
            await conn.execute(
                "SELECT pacerd.schedule(job_id => 'future-' || g, kind => 'k', destination => 'd',"
                " payload => '{}', eligible_at => $1::timestamptz + interval '1 second')"
                " FROM generate_series(1, 100) g",
                now,
            )
        start = asyncio.Event()
        tasks = [
            asyncio.create_task(_claimer(led, "d", f"claimer-{i}", now, start))
            for i in range(CLAIMERS)
        ]
        await asyncio.sleep(0)
        start.set()
        per_claimer = await asyncio.wait_for(asyncio.gather(*tasks), timeout=60)

        claimed = [j for batch in per_claimer for j in batch]
        counts = collections.Counter(j.job_id for j in claimed)
        assert [job_id for job_id, n in counts.items() if n > 1] == []  # never twice
        assert set(counts) == {f"job-{g}" for g in range(1, ROWS + 1)}  # every due row, once
        assert {j.attempt for j in claimed} == {1}
        # The work was really shared: more than one claimer took part.
        assert sum(1 for batch in per_claimer if batch) > 1

        conn = await asyncpg.connect(db_dsn)
        try:
            rows = await conn.fetch(
                "SELECT state, attempt, destination, count(*) AS n FROM pacerd.jobs"
                " GROUP BY 1, 2, 3 ORDER BY 1, 2, 3"
            )
            assert [tuple(r) for r in rows] == [
                ("claimed", 1, "d", ROWS),
                ("scheduled", 0, "d", 100),
                ("scheduled", 0, "e", 100),
            ]
            # One 'claimed' history row per claim, by the claimer that won it.
            events = await conn.fetch(
                "SELECT job_id, count(*) AS n, min(detail->>'by') AS by FROM pacerd.job_events"
                " WHERE event = 'claimed' GROUP BY job_id"
            )
            assert len(events) == ROWS
            assert all(r["n"] == 1 for r in events)
            owner = {j.job_id: f"claimer-{i}" for i, batch in enumerate(per_claimer) for j in batch}
            assert all(owner[r["job_id"]] == r["by"] for r in events)
            claimed_by = await conn.fetch(
                "SELECT job_id, claimed_by FROM pacerd.jobs WHERE state = 'claimed'"
            )
            assert all(owner[r["job_id"]] == r["claimed_by"] for r in claimed_by)
        finally:
            await conn.close()
    finally:
        await led.close()


async def test_concurrent_claims_and_confirms_with_releases(db_dsn: str) -> None:
    """Claimers that release part of each batch (a failed publish) and confirm
    the rest: released rows come back with a higher attempt, and still no row
    is ever held by two claimers at once."""
    led = await ledger.Ledger.connect(db_dsn, max_size=CLAIMERS)
    rows = 1_000
    try:
        now = dt.datetime.now(dt.UTC)
        async with led.transaction() as conn:
            await conn.execute(
                "SELECT pacerd.schedule(job_id => 'job-' || g, kind => 'k', destination => 'd',"
                " payload => '{}', eligible_at => $1::timestamptz - make_interval(secs => g))"
                " FROM generate_series(1, $2::int) g",
                now,
                rows,
            )
        held: set[str] = set()  # claimed and not released: offered rows stay here for good
        offered: collections.Counter[str] = collections.Counter()

        async def worker(name: str) -> None:
            while True:
                got = await led.claim_due(
                    "d",
                    live_limit=0,
                    limit=20,
                    claim_seconds=60.0,
                    epoch=0,
                    live_window_seconds=0.0,
                    instance=name,
                    now=now,
                )
                if not got and await led.has_due("d", now=now) == 0:
                    return
                for j in got:
                    assert j.job_id not in held, f"{j.job_id} claimed while held or offered"
                    held.add(j.job_id)
                # A failed publish for every third row's first attempt.
                release = [
                    j.ref for j in got if j.attempt == 1 and int(j.job_id.split("-")[1]) % 3 == 0
                ]
                confirm = [j.ref for j in got if j.ref not in release]
                for ref in release:
                    held.discard(ref.job_id)  # it may be claimed again, by anyone
                released = await led.release_claims(release, reason="nack", now=now)
                assert sorted(r.job_id for r in released) == sorted(r.job_id for r in release)
                done = await led.mark_offered(confirm, offer_seconds=60.0, now=now)
                assert sorted(r.job_id for r in done) == sorted(r.job_id for r in confirm)
                offered.update(r.job_id for r in done)
                await asyncio.sleep(0)

        await asyncio.wait_for(
            asyncio.gather(*(worker(f"w{i}") for i in range(CLAIMERS))), timeout=60
        )
        assert len(offered) == rows
        assert set(offered.values()) == {1}  # each row offered exactly once
        conn = await asyncpg.connect(db_dsn)
        try:
            states = await conn.fetch("SELECT state, count(*) AS n FROM pacerd.jobs GROUP BY 1")
            assert [tuple(r) for r in states] == [("offered", rows)]
            # a released row was claimed again with the next attempt: never reused
            reused = await conn.fetchval(
                "SELECT count(*) FROM (SELECT job_id, attempt FROM pacerd.job_events"
                " WHERE event = 'claimed' GROUP BY 1, 2 HAVING count(*) > 1) s"
            )
            assert reused == 0
        finally:
            await conn.close()
    finally:
        await led.close()
