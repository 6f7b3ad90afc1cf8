"""Correctness of the performance paths (benchmarks live in bench/, never here).

``Broker.publish_many`` pipelines a batch's confirms and reports each
message's fate, as ``publish`` would for that message alone.

``pacerd.report_many`` (migration 0002, used by the ``apply_reports`` query)
must give a batch exactly what calling ``pacerd.report`` on each report, in
order, in one transaction, gives: the same results, job rows, history and
destination counters. Each test builds one ledger state, applies the batch
both ways in a transaction that is rolled back, and compares.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import uuid
from typing import TYPE_CHECKING, Any

import aio_pika
import asyncpg
import pytest

from pacerd import ledger
from pacerd.errors import BrokerUnavailable, PublishRejected
from pacerd.models import ClaimedJob, JobRef, Outcome, Report
from pacerd.publisher import Broker, ready_queue_name

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Sequence

pytestmark = pytest.mark.services

SEQUENTIAL = """
SELECT pacerd.report(job_id => r.job_id, attempt => r.attempt, outcome => r.outcome,
                     retry_after_s => r.retry_after_s, error => r.error,
                     detail => r.detail, cursor => r.cursor) AS result
FROM unnest($1::text[], $2::int[], $3::text[], $4::float8[], $5::text[], $6::jsonb[],
            $7::jsonb[]) WITH ORDINALITY AS r(job_id, attempt, outcome, retry_after_s, error,
                                             detail, cursor, n)
ORDER BY r.n
"""

# Timestamps as "now" / "now+<interval>" / absolute, so that two transactions
# (each with its own now()) compare equal when they did the same thing: the
# only future values reports write are now()-based (a refusal's Retry-After,
# a retry's backoff, a cool-down).
_TS = (
    "CASE WHEN {c} IS NULL THEN NULL WHEN {c} = now() THEN 'now'"
    " WHEN {c} > now() THEN 'now+' || ({c} - now())::text ELSE {c}::text END"
)

JOBS_SNAPSHOT = f"""
SELECT job_id, state, attempt, failures, ever_offered, cursor::text, last_error, claimed_by,
       {_TS.format(c="next_attempt_at")} AS next_attempt_at,
       lease_expires_at::text,  -- reports only ever clear it
       {_TS.format(c="updated_at")} AS updated_at
FROM pacerd.jobs ORDER BY job_id
"""

EVENTS_SNAPSHOT = f"""
SELECT job_id, attempt, event, (detail - 'next_attempt_at')::text AS detail,
       detail ? 'next_attempt_at' AS has_next, {_TS.format(c="at")} AS at
FROM pacerd.job_events ORDER BY job_id, id
"""

DESTINATIONS_SNAPSHOT = f"""
SELECT destination, epoch, n_accepted, n_refused, n_accepted_fresh, n_refused_fresh,
       n_retry_after, {_TS.format(c="cooldown_until")} AS cooldown_until,
       {_TS.format(c="updated_at")} AS updated_at
FROM pacerd.destinations ORDER BY destination
"""


@pytest.fixture
async def led(db_dsn: str) -> AsyncIterator[ledger.Ledger]:
    led = await ledger.Ledger.connect(db_dsn, max_size=2)
    yield led
    await led.close()


def _args(reports: Sequence[Report]) -> list[list[Any]]:
    return [
        [r.job_id for r in reports],
        [r.attempt for r in reports],
        [str(r.outcome) for r in reports],
        [r.retry_after_s for r in reports],
        [r.error for r in reports],
        [None if r.detail is None else json.dumps(r.detail) for r in reports],
        [None if r.cursor is None else json.dumps(r.cursor) for r in reports],
    ]


async def _both_ways(
    conn: asyncpg.Connection, led: ledger.Ledger, reports: Sequence[Report]
) -> list[str]:
    """Applies ``reports`` sequentially and with the ``apply_reports`` query,
    each in a rolled-back transaction; asserts equal outcomes; returns them."""
    snapshots = []
    for sql in (SEQUENTIAL, led.queries["apply_reports"].sql):
        tx = conn.transaction()
        await tx.start()
        try:
            await conn.execute("SELECT setseed(0.25)")  # the same backoff jitter both ways
            rows = await conn.fetch(sql, *_args(reports))
            snapshots.append(
                (
                    [r["result"] for r in rows],
                    [tuple(r) for r in await conn.fetch(JOBS_SNAPSHOT)],
                    [tuple(r) for r in await conn.fetch(EVENTS_SNAPSHOT)],
                    [tuple(r) for r in await conn.fetch(DESTINATIONS_SNAPSHOT)],
                )
            )
        finally:
            await tx.rollback()
    sequential, batched = snapshots
    assert batched[0] == sequential[0]
    assert batched[1] == sequential[1]
    assert batched[2] == sequential[2]
    assert batched[3] == sequential[3]
    return sequential[0]


async def _jobs(conn: asyncpg.Connection, destination: str, names: Sequence[str]) -> None:
    past = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=30)
    for name in names:
        await conn.execute(
            "SELECT pacerd.schedule(job_id => $1, kind => 'k', destination => $2,"
            " payload => '{}'::jsonb, eligible_at => $3, max_attempts => 3)",
            name,
            destination,
            past,
        )


async def _claim(led: ledger.Ledger, destination: str, *, epoch: int) -> list[JobRef]:
    jobs = await led.claim_due(
        destination, live_limit=0, limit=100, claim_seconds=60, epoch=epoch,
        live_window_seconds=0, instance="test",
    )  # fmt: skip
    return [j.ref for j in jobs]


async def test_report_many_matches_sequential_reports(db_dsn: str, led: ledger.Ledger) -> None:
    conn = await asyncpg.connect(db_dsn)
    try:
        await _jobs(conn, "d1", ["ok-offered", "ok-claimed", "ok-detail", "expired", "wrong",
                                 "refused", "retry", "fail", "continue", "twice", "last-try",
                                 "keeps-cursor"])  # fmt: skip
        await _jobs(conn, "d2", ["old-epoch"])
        claimed = await _claim(led, "d1", epoch=0)
        old = await _claim(led, "d2", epoch=0)
        await led.save_pacer_state("d2", {}, epoch=1)  # a cut: d2's earlier admissions are stale
        await _jobs(conn, "d2", ["new-epoch"])
        new = await _claim(led, "d2", epoch=1)
        await led.mark_offered(
            [r for r in claimed + old + new if r.job_id != "ok-claimed"], offer_seconds=60
        )
        await conn.execute(
            "UPDATE pacerd.jobs SET lease_expires_at = now() - interval '1 second'"
            " WHERE job_id = 'expired'"
        )
        await conn.execute("UPDATE pacerd.jobs SET failures = 2 WHERE job_id = 'last-try'")
        await conn.execute(
            "UPDATE pacerd.jobs SET cursor = '{\"p\": 1}' WHERE job_id = 'keeps-cursor'"
        )
        ok, refused, retry = Outcome.OK, Outcome.REFUSED, Outcome.RETRY
        reports = [
            Report(job_id="ok-offered", attempt=1, outcome=ok),
            Report(job_id="ok-claimed", attempt=1, outcome=ok),
            Report(
                job_id="ok-detail",
                attempt=1,
                outcome=ok,
                detail={"tokens": 7},
                cursor={"page": 2},
                error="ignored",
                retry_after_s=3.0,
            ),
            Report(job_id="expired", attempt=1, outcome=ok),
            Report(job_id="wrong", attempt=2, outcome=ok),
            Report(job_id="nope", attempt=1, outcome=ok),
            Report(job_id="refused", attempt=1, outcome=refused, retry_after_s=30.0),
            Report(job_id="retry", attempt=1, outcome=retry, error="flaky"),
            Report(job_id="last-try", attempt=1, outcome=retry, error="flaky again"),
            Report(job_id="fail", attempt=1, outcome=Outcome.FAIL, error="bad"),
            Report(job_id="continue", attempt=1, outcome=Outcome.CONTINUE, cursor={"at": 3}),
            Report(job_id="twice", attempt=1, outcome=ok),
            Report(job_id="twice", attempt=1, outcome=ok),
            Report(job_id="old-epoch", attempt=1, outcome=ok),
            Report(job_id="new-epoch", attempt=1, outcome=ok),
            Report(job_id="keeps-cursor", attempt=1, outcome=ok),
        ]
        results = await _both_ways(conn, led, reports)
        assert results == ["applied", "applied", "applied", "stale", "stale", "unknown",
                           "applied", "applied", "applied", "applied", "applied", "applied",
                           "stale", "applied", "applied", "applied"]  # fmt: skip
        assert await _both_ways(conn, led, []) == []
        # Through the ledger (a real commit): the counters add up once each.
        assert await led.apply_reports(reports) == results
        row = await conn.fetchrow(
            "SELECT n_accepted, n_accepted_fresh FROM pacerd.destinations WHERE destination = 'd2'"
        )
        assert row is not None
        assert (row["n_accepted"], row["n_accepted_fresh"]) == (2, 1)
    finally:
        await conn.close()


async def test_report_many_rejects_like_report(db_dsn: str, led: ledger.Ledger) -> None:
    """An invalid report raises pacerd.report's own error (22023) and undoes the
    batch; ``apply_reports`` then applies the others row by row."""
    conn = await asyncpg.connect(db_dsn)
    try:
        await _jobs(conn, "d1", ["a", "b"])
        await led.mark_offered(await _claim(led, "d1", epoch=0), offer_seconds=60)
        reports = [
            Report(job_id="a", attempt=1, outcome=Outcome.OK),
            Report(job_id="b", attempt=1, outcome=Outcome.OK, retry_after_s=-1.0),
        ]
        messages = []
        for sql in (SEQUENTIAL, led.queries["apply_reports"].sql):
            with pytest.raises(asyncpg.PostgresError) as info:
                await conn.fetch(sql, *_args(reports))
            assert getattr(info.value, "sqlstate", None) == "22023"
            messages.append(str(info.value))
        assert messages[0] == messages[1]
        assert await conn.fetchval("SELECT state FROM pacerd.jobs WHERE job_id = 'a'") == "offered"
        results = await led.apply_reports(reports)
        assert results[0] == "applied"
        assert results[1].startswith("rejected: ")
    finally:
        await conn.close()


async def test_report_many_refuses_arrays_of_different_lengths(
    db_dsn: str, led: ledger.Ledger
) -> None:
    """One element per report in every array: a short ``retry_after_s`` would
    otherwise apply its last report without the Retry-After (unnest pads with
    NULLs). An optional array may be empty or NULL: none for every report."""
    conn = await asyncpg.connect(db_dsn)
    try:
        await _jobs(conn, "d1", ["a", "b"])
        await led.mark_offered(await _claim(led, "d1", epoch=0), offer_seconds=60)
        call = (
            "SELECT pacerd.report_many($1::text[], $2::int[], $3::text[], $4::float8[],"
            " $5::text[], $6::jsonb[], $7::jsonb[])"
        )
        two = (["a", "b"], [1, 1], ["ok", "refused"])
        cases = [
            ((["a", "b"], [1], ["ok", "ok"], None, None, None, None), "got 2, 1 and 2"),
            ((*two, [30.0], None, None, None), "retry_after_s needs one element per report (2)"),
            ((*two, None, ["e", "e", "e"], None, None), "error needs one element per report"),
            ((*two, None, None, ['{"x": 1}'], None), "detail needs one element per report"),
            ((*two, None, None, None, ["{}"] * 3), "cursor needs one element per report"),
        ]
        for args, message in cases:
            with pytest.raises(asyncpg.PostgresError) as info:
                await conn.fetchval(call, *args)
            assert getattr(info.value, "sqlstate", None) == "22023"
            assert str(info.value).startswith("pacerd.report_many: "), str(info.value)
            assert message in str(info.value)
        states = await conn.fetch("SELECT state FROM pacerd.jobs ORDER BY job_id")
        assert [r["state"] for r in states] == ["offered", "offered"]  # nothing applied

        got = await conn.fetchval(call, ["a", "b"], [1, 1], ["ok", "ok"], [], [], [], [])
        assert got == ["applied", "applied"]
    finally:
        await conn.close()


async def test_mark_offered_is_fenced(db_dsn: str, led: ledger.Ledger) -> None:
    """The reshaped mark_offered still marks only claimed jobs at their attempt."""
    conn = await asyncpg.connect(db_dsn)
    try:
        await _jobs(conn, "d1", ["a", "b", "c"])
        refs = {r.job_id: r for r in await _claim(led, "d1", epoch=0)}
        got = await led.mark_offered(
            [refs["a"], JobRef(job_id="b", attempt=2), JobRef(job_id="zz", attempt=1)],
            offer_seconds=60,
        )
        assert got == [refs["a"]]
        assert await led.mark_offered([refs["a"]], offer_seconds=60) == []  # already offered
        states = {
            r["job_id"]: r["state"]
            for r in await conn.fetch("SELECT job_id, state FROM pacerd.jobs")
        }
        assert states == {"a": "offered", "b": "claimed", "c": "claimed"}
    finally:
        await conn.close()


def _claimed(job_id: str, destination: str) -> ClaimedJob:
    return ClaimedJob(
        job_id=job_id, kind="k", destination=destination, attempt=1, revision=0,
        payload_json='{"n": 1}', cursor_json=None,
        eligible_at=dt.datetime(2025, 1, 1, tzinfo=dt.UTC), live=False,
    )  # fmt: skip


async def test_publish_many_confirms_each_message_in_order(amqp_url: str) -> None:
    """The pipelined batch publish: every confirmed message is in the queue with
    its id and headers; an unroutable one is rejected on its own."""
    destination = f"perf-{uuid.uuid4().hex[:8]}"
    queue = ready_queue_name(destination)
    broker = Broker(url=amqp_url, publish_timeout_seconds=10)
    await broker.connect()
    try:
        await broker.declare_destination(destination, queue)
        jobs = [_claimed(f"j{i}", destination) for i in range(300)]
        jobs.insert(150, _claimed("lost", "perf-nowhere"))
        headers = [{"traceparent": f"00-{i:032x}-{i:016x}-01"} for i in range(len(jobs))]
        results = await broker.publish_many(jobs, headers)
        assert [r is None for r in results] == [j.job_id != "lost" for j in jobs]
        assert isinstance(results[150], PublishRejected)
        assert await broker.publish_many([], []) == []
        connection = await aio_pika.connect(amqp_url)
        try:
            channel = await connection.channel()
            declared = await channel.get_queue(queue, ensure=False)
            got = []
            while (message := await declared.get(fail=False, no_ack=True)) is not None:
                got.append((message.message_id, (message.headers or {}).get("traceparent")))
            await channel.queue_delete(queue)
        finally:
            await connection.close()
        expected = [
            (f"{j.job_id}:1", h["traceparent"])
            for j, h in zip(jobs, headers, strict=True)
            if j.job_id != "lost"
        ]
        assert sorted(got) == sorted(expected)
    finally:
        await broker.close()


async def test_publish_many_without_a_broker_fails_each_message() -> None:
    broker = Broker(url="amqp://guest:guest@127.0.0.1:1/", publish_timeout_seconds=1)
    results = await broker.publish_many([_claimed("a", "d"), _claimed("b", "d")], [{}, {}])
    assert all(isinstance(r, BrokerUnavailable) for r in results)


async def test_outcome_batches_ack_by_tag_and_end_when_the_broker_cancels(amqp_url: str) -> None:
    """Deliveries come in batches of what is buffered (up to the prefetch), one
    multiple-ack settles a batch, and a consumer the broker cancels (its queue
    deleted) ends the batches instead of waiting forever."""
    queue = f"perf-consume-{uuid.uuid4().hex[:8]}"
    connection = await aio_pika.connect(amqp_url)
    broker = Broker(url=amqp_url, publish_timeout_seconds=10)
    try:
        channel = await connection.channel()
        await channel.declare_queue(queue, durable=True)
        await broker.connect()
        for i in range(30):
            await broker.publish_raw(queue, b"x", headers={"n": str(i)})
        async with broker.consume(queue, prefetch=10) as batches:
            seen: list[str] = []
            while len(seen) < 30:
                batch = await asyncio.wait_for(batches.next_batch(), 10)
                assert 1 <= len(batch) <= 10
                assert all(d.body == b"x" for d in batch)
                seen += [str(d.headers["n"]) for d in batch]
                await batches.ack(batch)
            assert seen == [str(i) for i in range(30)]
            await channel.queue_delete(queue)
            with pytest.raises(BrokerUnavailable):
                await asyncio.wait_for(batches.next_batch(), 10)
    finally:
        await broker.close()
        await connection.close()
