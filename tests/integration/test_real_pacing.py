"""S3 of the pacing scenarios on the real path: the daemon, the broker, a
worker of the worker library and the model upstream over HTTP, which answers
every 429 with a Retry-After and locks a hammering client out for a while.

The daemon starts well above the upstream's capacity, so refusals with a
Retry-After are certain. Every job completes, and no claim falls inside an
advertised cool-down: each claim's time (its ``claimed`` event) is compared
with each window the ledger recorded (a ``refused`` event's time plus its
Retry-After), both read from the database's clock. The claim statement itself
checks the destination's cool-down, so this holds without a margin."""

from __future__ import annotations

import uuid

import anyio
import anyio.to_thread
import asyncpg
import pytest
from dispatch_helpers import daemon_config, delete_queues, running_daemon, schedule_many

from pacerd.publisher import ready_queue_name
from pacerd.testing.upstream import CapacitySchedule, ModelUpstream, UpstreamParams
from pacerd.worker import Worker
from pacerd_demo.app import build_app

pytestmark = [pytest.mark.services, pytest.mark.timeout(120)]

JOBS = 300
CAPACITY = 80  # calls/s; the daemon starts at 200/s (daemon_config)


async def test_s3_every_job_completes_and_no_claim_falls_inside_a_retry_after(
    db_dsn: str, amqp_url: str
) -> None:
    destination = f"s3-{uuid.uuid4().hex[:8]}"
    params = UpstreamParams(
        schedule=CapacitySchedule.parse(f"0:{CAPACITY}"),
        burst_seconds=0.1,
        retry_after=True,
        penalty_seconds=2.0,
        latency_median_ms=10.0,
    )
    await schedule_many(db_dsn, destination, JOBS, prefix=destination)
    cfg = await anyio.to_thread.run_sync(  # load_config reads the working directory
        lambda: daemon_config(db_dsn, amqp_url, pacing__initial_rate=200)
    )
    try:
        async with ModelUpstream(params, seed=0) as upstream, running_daemon(cfg):
            worker = Worker(
                build_app({destination: upstream.url}, prefetch=50),
                broker_url=amqp_url,
                dsn=db_dsn,
            )
            async with anyio.create_task_group() as tg:
                await tg.start(worker.run)
                conn = await asyncpg.connect(db_dsn)
                try:
                    with anyio.fail_after(90):
                        while await conn.fetchval(
                            "SELECT count(*) FROM pacerd.jobs"
                            " WHERE destination = $1 AND state <> 'completed'",
                            destination,
                        ):
                            await anyio.sleep(0.2)
                finally:
                    await conn.close()
                worker.request_stop()
    finally:
        await delete_queues(amqp_url, [ready_queue_name(destination)])

    conn = await asyncpg.connect(db_dsn)
    try:
        states = await conn.fetch(
            "SELECT state, count(*) AS n FROM pacerd.jobs WHERE destination = $1 GROUP BY state",
            destination,
        )
        windows = await conn.fetch(
            "SELECT e.at AS opened,"
            " e.at + make_interval(secs => (e.detail->>'retry_after_s')::float8) AS closes"
            " FROM pacerd.job_events e JOIN pacerd.jobs j USING (job_id)"
            " WHERE j.destination = $1 AND e.event = 'refused' AND e.detail ? 'retry_after_s'",
            destination,
        )
        claims = await conn.fetch(
            "SELECT e.job_id, e.attempt, e.at FROM pacerd.job_events e"
            " JOIN pacerd.jobs j USING (job_id) WHERE j.destination = $1 AND e.event = 'claimed'",
            destination,
        )
        cooldown_until = await conn.fetchval(
            "SELECT cooldown_until FROM pacerd.destinations WHERE destination = $1", destination
        )
    finally:
        await conn.close()

    assert {r["state"]: r["n"] for r in states} == {"completed": JOBS}
    assert windows, "the upstream refused nothing with a Retry-After: the scenario did not run"
    assert len(claims) > JOBS  # refused jobs were claimed again
    assert cooldown_until == max(w["closes"] for w in windows)
    inside = [
        (c["job_id"], c["attempt"], c["at"], w["opened"], w["closes"])
        for c in claims
        for w in windows
        if w["opened"] < c["at"] < w["closes"]
    ]
    assert inside == []
