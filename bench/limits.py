"""The raw limit of this machine's PostgreSQL + RabbitMQ for pacerd's design:
what the same work costs with nothing of pacerd in the way (no pacing, no
telemetry, no history rows, no per-message tasks).

    .venv/bin/python -m bench.limits                  # ~1-2 minutes
    .venv/bin/python -m bench.limits --jobs 20000 --repeat 3

Measures, each ``--repeat`` times (the median is printed):

* claim path alone: one ``UPDATE … WHERE job_id IN (SELECT … ORDER BY
  next_attempt_at LIMIT n FOR UPDATE SKIP LOCKED) RETURNING …`` then one mark
  per batch, at batch 100 and 1,000 (rows/s);
* publish with publisher confirms (persistent, ~200 B, mandatory, quorum
  queue): awaiting each confirm, and with 100 / 1,000 confirms in flight;
* raw end to end: claim 500 → publish all with confirms → mark offered, in a
  loop, no pacing; once with nobody consuming the ready queue and once with
  the no-op acking consumer that ``dispatch.py`` uses (the denominator of its
  ratios); and once more with the consumer, each batch's messages written as
  one frame buffer (``publisher.write_batch``, as pacerd itself publishes):
  the stricter limit, which ``dispatch.py`` reports beside the first.

``dispatch.py`` imports ``raw_end_to_end`` so that every ratio is taken
against a limit measured in the same run. Needs the ``pacerd-bench`` vhost
(see ``common.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import aiormq
import asyncpg
from pamqp.commands import Basic

from bench import common
from pacerd.models import ClaimedJob
from pacerd.publisher import ready_body, write_batch

if TYPE_CHECKING:
    from collections.abc import Awaitable

DB = "pacerd_bench_limits"

CLAIM_SQL = """
UPDATE pacerd.jobs j SET state = 'claimed', attempt = j.attempt + 1,
       lease_expires_at = now() + interval '30 seconds', updated_at = now()
WHERE j.job_id IN (
    SELECT job_id FROM pacerd.jobs
    WHERE destination = $1 AND state = 'scheduled' AND next_attempt_at <= now()
    ORDER BY next_attempt_at LIMIT $2
    FOR UPDATE SKIP LOCKED)
RETURNING j.job_id, j.kind, j.destination, j.attempt, j.revision, j.payload::text AS payload,
          j.cursor::text AS cursor, j.next_attempt_at
"""

MARK_SQL = """
UPDATE pacerd.jobs SET state = 'offered', ever_offered = true,
       lease_expires_at = now() + interval '300 seconds', updated_at = now()
WHERE job_id = ANY($1::text[]) AND state = 'claimed'
"""


async def _reseed(dsn: str, n: int) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute("TRUNCATE pacerd.jobs, pacerd.job_events")
    finally:
        await conn.close()
    await common.seed(dsn, n)


def _job(r: asyncpg.Record) -> ClaimedJob:
    return ClaimedJob(
        job_id=r["job_id"],
        kind=r["kind"],
        destination=r["destination"],
        attempt=r["attempt"],
        revision=r["revision"],
        payload_json=r["payload"],
        cursor_json=r["cursor"],
        eligible_at=r["next_attempt_at"],
        live=False,
    )


async def claim_only(dsn: str, *, batch: int, n: int) -> float:
    """Rows/s through claim + one mark per batch."""
    await _reseed(dsn, n)
    conn = await asyncpg.connect(dsn)
    try:
        claim = await conn.prepare(CLAIM_SQL)
        mark = await conn.prepare(MARK_SQL)
        done = 0
        t0 = time.perf_counter()
        while True:
            rows = await claim.fetch(common.DESTINATION, batch)
            if not rows:
                break
            await mark.fetch([r["job_id"] for r in rows])
            done += len(rows)
        return done / (time.perf_counter() - t0)
    finally:
        await conn.close()


def _properties(job_id: str, attempt: int) -> aiormq.spec.Basic.Properties:
    return aiormq.spec.Basic.Properties(
        content_type="application/json",
        delivery_mode=2,
        message_id=f"{job_id}:{attempt}",
        correlation_id=job_id,
    )


async def _publish(channel: aiormq.abc.AbstractChannel, body: bytes, job_id: str, n: int) -> None:
    confirm = await channel.basic_publish(
        body,
        exchange="pacerd.ready",
        routing_key=common.DESTINATION,
        properties=_properties(job_id, n),
        mandatory=True,
    )
    if not isinstance(confirm, Basic.Ack):
        raise RuntimeError(f"not acknowledged: {confirm!r}")


async def publish_confirms(*, in_flight: int, n: int) -> float:
    """Msg/s publishing ~200 B persistent messages, ``in_flight`` confirms pending."""
    await common.reset_queues()
    body = b'{"job_id":"j-1","kind":"bench","payload":{"n":1,"pad":"' + common.PAD.encode()
    body += b'"},"destination":"bench","attempt":1,"revision":0,"cursor":null,' + (
        b'"eligible_at":"2025-01-01T00:00:00+00:00"}' + b" " * 40
    )
    connection = await aiormq.connect(common.AMQP_URL)
    try:
        channel = await connection.channel(publisher_confirms=True)
        window = asyncio.Semaphore(in_flight)

        async def one(i: int) -> None:
            try:
                await _publish(channel, body, f"j-{i}", 1)
            finally:
                window.release()

        t0 = time.perf_counter()
        tasks = set()
        for i in range(n):
            await window.acquire()
            task = asyncio.create_task(one(i))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        await asyncio.gather(*tasks)
        return n / (time.perf_counter() - t0)
    finally:
        await connection.close()


@dataclass(frozen=True, slots=True)
class RawRun:
    jobs_per_second: float
    cpu_per_1000: float  # CPU seconds of this (the raw loop's) process per 1,000 jobs


async def raw_end_to_end(
    dsn: str,
    *,
    n: int,
    batch: int = 500,
    consumer: bool = True,
    reseed: bool = True,
    one_write: bool = False,
) -> RawRun:
    """Claim ``batch`` → publish all with confirms → mark offered, looped until
    ``n`` jobs are offered. ``consumer`` runs the no-op acking worker.
    ``one_write``: the batch's messages go out as one frame buffer
    (``publisher.write_batch``, as pacerd publishes) instead of one
    ``basic_publish`` each (the issue's definition of the raw loop)."""
    if reseed:
        await _reseed(dsn, n)
    await common.reset_queues()
    worker = common.start_worker("ack") if consumer else None
    connection = await aiormq.connect(common.AMQP_URL)
    conn = await asyncpg.connect(dsn)
    try:
        channel = await connection.channel(publisher_confirms=True)
        claim = await conn.prepare(CLAIM_SQL)
        mark = await conn.prepare(MARK_SQL)
        done = 0
        t0 = time.perf_counter()
        cpu0 = time.process_time()
        while True:
            rows = await claim.fetch(common.DESTINATION, batch)
            if not rows:
                break
            jobs = [_job(r) for r in rows]
            if one_write:
                confirms = await write_batch(
                    channel,
                    [
                        ("pacerd.ready", common.DESTINATION, ready_body(j),
                         _properties(j.job_id, j.attempt))
                        for j in jobs
                    ],
                )  # fmt: skip
                if not all(isinstance(c, Basic.Ack) for c in await asyncio.gather(*confirms)):
                    raise RuntimeError("a message was not acknowledged")
            else:
                await asyncio.gather(
                    *(_publish(channel, ready_body(j), j.job_id, j.attempt) for j in jobs)
                )
            await mark.fetch([j.job_id for j in jobs])
            done += len(jobs)
        return RawRun(
            jobs_per_second=done / (time.perf_counter() - t0),
            cpu_per_1000=(time.process_time() - cpu0) / done * 1000,
        )
    finally:
        await conn.close()
        await connection.close()
        if worker is not None:
            common.stop_process(worker)


async def _rate(run: Awaitable[RawRun]) -> float:
    return (await run).jobs_per_second


async def measure(jobs: int, repeat: int) -> list[tuple[str, float, str]]:
    dsn = await common.fresh_ledger(DB)
    results: list[tuple[str, float, str]] = []

    async def rep(label: str, unit: str, fn: object) -> None:
        values = [await fn() for _ in range(repeat)]  # type: ignore[operator]
        results.append((label, common.median(values), unit))
        print(f"  {label}: {', '.join(f'{v:,.0f}' for v in values)} {unit}", flush=True)

    try:
        await rep("claim + mark, batch 100", "rows/s", lambda: claim_only(dsn, batch=100, n=jobs))
        await rep(
            "claim + mark, batch 1,000", "rows/s", lambda: claim_only(dsn, batch=1000, n=jobs)
        )
        await rep(
            "publish, awaiting each confirm", "msg/s", lambda: publish_confirms(in_flight=1, n=1500)
        )
        await rep(
            "publish, 100 confirms in flight", "msg/s",
            lambda: publish_confirms(in_flight=100, n=jobs),
        )  # fmt: skip
        await rep(
            "publish, 1,000 confirms in flight", "msg/s",
            lambda: publish_confirms(in_flight=1000, n=jobs),
        )  # fmt: skip
        await rep(
            "raw end to end (claim 500 → publish → mark), no consumer", "jobs/s",
            lambda: _rate(raw_end_to_end(dsn, n=jobs, consumer=False)),
        )  # fmt: skip
        await rep(
            "raw end to end, no-op acking consumer", "jobs/s",
            lambda: _rate(raw_end_to_end(dsn, n=jobs, consumer=True)),
        )  # fmt: skip
        await rep(
            "raw end to end, no-op acking consumer, one write per batch", "jobs/s",
            lambda: _rate(raw_end_to_end(dsn, n=jobs, consumer=True, one_write=True)),
        )  # fmt: skip
    finally:
        await common.reset_queues()
        await common.drop_database(DB)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=20_000, help="jobs per measurement")
    parser.add_argument("--repeat", type=int, default=3, help="runs per figure (median)")
    args = parser.parse_args()
    print(f"# limits — {time.strftime('%Y-%m-%d %H:%M:%S %Z')}")
    print(f"# {common.machine_description()}")
    results = common.run(lambda: measure(args.jobs, args.repeat))
    print()
    print(common.table(["raw path", f"median of {args.repeat}", "unit"], results))


if __name__ == "__main__":
    main()
