"""The daemon against the real PostgreSQL and RabbitMQ: drain, budgets,
unroutable publishes, stale and malformed outcomes, expired offers."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import aio_pika
import anyio
import asyncpg
import pytest
from dispatch_helpers import (
    WorkerPool,
    close_broker_connections,
    daemon_config,
    delete_queues,
    purge_outcomes,
    running_daemon,
    schedule_many,
    state_counts,
    unique,
    wait_for_states,
    worker_pool,
)

pytestmark = [pytest.mark.services, pytest.mark.timeout(120)]


async def test_drains_2000_jobs_over_three_destinations_exactly_once(
    db_dsn: str, amqp_url: str
) -> None:
    destinations = [unique("drain") for _ in range(3)]
    queues = [f"pacerd.ready.{d}" for d in destinations]
    await purge_outcomes(amqp_url)
    sizes = [900, 600, 500]
    for destination, n in zip(destinations, sizes, strict=True):
        await schedule_many(db_dsn, destination, n, prefix=destination)
        await schedule_many(
            db_dsn, destination, 5, prefix=f"future-{destination}", eligible_in_seconds=3600
        )
    cfg = daemon_config(db_dsn, amqp_url)
    try:
        async with (
            running_daemon(cfg) as (_daemon, ticks),
            worker_pool(amqp_url, queues, WorkerPool()) as pool,
        ):
            counts = await wait_for_states(
                db_dsn, lambda c: c.get("completed", 0) >= 2000, within=60
            )
    finally:
        await delete_queues(amqp_url, queues)

    assert counts == {"completed": 2000, "scheduled": 15}
    conn = await asyncpg.connect(db_dsn)
    try:
        completions = await conn.fetch(
            "SELECT job_id, count(*) AS n FROM pacerd.job_events WHERE event = 'completed'"
            " GROUP BY job_id"
        )
        future = await conn.fetch(
            "SELECT attempt, state FROM pacerd.jobs WHERE job_id LIKE 'future-%'"
        )
        # Every re-offer must be explained by an event (release or lease expiry).
        reoffered = await conn.fetch(
            "SELECT job_id, array_agg(event || coalesce(':' || (detail->>'reason'), '')"
            " ORDER BY id) AS events FROM pacerd.job_events WHERE job_id IN"
            " (SELECT job_id FROM pacerd.jobs WHERE attempt > 1) GROUP BY job_id"
        )
    finally:
        await conn.close()
    assert len(completions) == 2000
    assert all(r["n"] == 1 for r in completions), "a job was completed twice"
    assert all(r["attempt"] == 0 and r["state"] == "scheduled" for r in future)
    assert not [job for job in pool.received if job["job_id"].startswith("future-")]
    assert max(pool.message_ids.values()) == 1, "a message id was delivered twice"
    per_destination = Counter(job["destination"] for job in pool.received)
    assert per_destination == dict(zip(destinations, sizes, strict=True)), [
        dict(r) for r in reoffered
    ]
    for tick in ticks.ticks:
        assert tick.claimed <= tick.budget, tick


async def test_unroutable_publish_is_returned_and_the_claim_released(
    db_dsn: str, amqp_url: str
) -> None:
    destination = unique("unroutable")
    await schedule_many(db_dsn, destination, 20, prefix=destination)
    cfg = daemon_config(db_dsn, amqp_url, BROKER__DECLARE_QUEUES="false")
    async with running_daemon(cfg) as (_daemon, ticks):
        with anyio.fail_after(20):
            while not any(t.released for t in ticks.ticks if t.destination == destination):
                await anyio.sleep(0.1)
    conn = await asyncpg.connect(db_dsn)
    try:
        rows = await conn.fetch(
            "SELECT state, attempt, failures FROM pacerd.jobs WHERE destination = $1", destination
        )
        released = await conn.fetchval(
            "SELECT count(*) FROM pacerd.job_events WHERE event = 'released'"
            " AND detail->>'reason' = 'publish_failed'"
        )
    finally:
        await conn.close()
    assert len(rows) == 20
    assert all(r["state"] == "scheduled" and r["failures"] == 0 for r in rows)
    assert released >= 1


async def _publish_outcomes(amqp_url: str, bodies: list[bytes]) -> None:
    connection = await aio_pika.connect(amqp_url)
    try:
        channel = await connection.channel(publisher_confirms=True)
        exchange = await channel.get_exchange("pacerd.outcomes")
        for body in bodies:
            await exchange.publish(aio_pika.Message(body, delivery_mode=2), routing_key="")
    finally:
        await connection.close()


async def _drain_invalid(amqp_url: str) -> list[bytes]:
    connection = await aio_pika.connect(amqp_url)
    bodies: list[bytes] = []
    try:
        channel = await connection.channel()
        try:
            queue = await channel.get_queue("pacerd.outcomes.invalid")
        except aio_pika.exceptions.ChannelNotFoundEntity:
            return bodies  # not declared yet: no daemon has run in this vhost
        while True:
            message = await queue.get(no_ack=True, fail=False)
            if message is None:
                return bodies
            bodies.append(message.body)
    finally:
        await connection.close()


async def test_stale_and_malformed_outcomes_and_expired_offers(db_dsn: str, amqp_url: str) -> None:
    destination = unique("faults")
    queue = f"pacerd.ready.{destination}"
    await purge_outcomes(amqp_url)
    await _drain_invalid(amqp_url)
    await schedule_many(db_dsn, destination, 3, prefix=destination)
    cfg = daemon_config(db_dsn, amqp_url, LEASES__OFFER_SECONDS="1")
    held: list[dict[str, Any]] = []
    try:
        async with running_daemon(cfg):
            # A worker that takes the offers but never reports: the offers expire.
            connection = await aio_pika.connect(amqp_url)
            channel = await connection.channel()
            ready = await channel.declare_queue(
                queue, durable=True, arguments={"x-queue-type": "quorum"}
            )
            with anyio.fail_after(20):
                while len(held) < 3:
                    message = await ready.get(no_ack=True, fail=False)
                    if message is None:
                        await anyio.sleep(0.05)
                        continue
                    held.append(json.loads(message.body))
            assert {job["attempt"] for job in held} == {1}
            # Expired offers are reclaimed and offered again with a new attempt.
            again: list[dict[str, Any]] = []
            with anyio.fail_after(20):
                while len(again) < 3:
                    message = await ready.get(no_ack=True, fail=False)
                    if message is None:
                        await anyio.sleep(0.05)
                        continue
                    again.append(json.loads(message.body))
            await connection.close()
            assert {job["attempt"] for job in again} == {2}
            # A report for the old attempt is stale; malformed ones are parked.
            stale = {"job_id": held[0]["job_id"], "attempt": 1, "outcome": "ok"}
            await _publish_outcomes(
                amqp_url,
                [
                    json.dumps(stale).encode(),
                    b"not json",
                    json.dumps({"job_id": "x", "attempt": "one", "outcome": "ok"}).encode(),
                    json.dumps({"job_id": "x", "attempt": 1, "outcome": "maybe"}).encode(),
                ],
            )
            with anyio.fail_after(15):
                parked: list[bytes] = []
                while len(parked) < 3:
                    parked += await _drain_invalid(amqp_url)
                    await anyio.sleep(0.1)
            assert b"not json" in parked
            with anyio.fail_after(15):
                while True:
                    conn = await asyncpg.connect(db_dsn)
                    try:
                        n = await conn.fetchval(
                            "SELECT count(*) FROM pacerd.job_events"
                            " WHERE job_id = $1 AND event = 'stale_report'",
                            held[0]["job_id"],
                        )
                    finally:
                        await conn.close()
                    if n:
                        break
                    await anyio.sleep(0.1)
    finally:
        await delete_queues(amqp_url, [queue])
    counts = await state_counts(db_dsn)
    assert "completed" not in counts


async def test_broker_connection_cut_mid_drain_loses_nothing(db_dsn: str, amqp_url: str) -> None:
    destination = unique("cut")
    queue = f"pacerd.ready.{destination}"
    await purge_outcomes(amqp_url)
    await schedule_many(db_dsn, destination, 1500, prefix=destination)
    cfg = daemon_config(db_dsn, amqp_url, PACING__INITIAL_RATE="300", PACING__MIN_RATE="300")
    cuts = 0
    try:
        async with (
            running_daemon(cfg) as (daemon, _ticks),
            worker_pool(amqp_url, [queue], WorkerPool()) as pool,
        ):
            await wait_for_states(db_dsn, lambda c: c.get("completed", 0) >= 300, within=30)
            cuts = await anyio.to_thread.run_sync(
                close_broker_connections, f"pacerd {daemon.instance}"
            )
            counts = await wait_for_states(
                db_dsn, lambda c: c.get("completed", 0) >= 1500, within=60
            )
    finally:
        await delete_queues(amqp_url, [queue])
    assert cuts >= 1
    assert counts == {"completed": 1500}
    conn = await asyncpg.connect(db_dsn)
    try:
        twice = await conn.fetchval(
            "SELECT count(*) FROM (SELECT job_id FROM pacerd.job_events WHERE event = 'completed'"
            " GROUP BY job_id HAVING count(*) > 1) s"
        )
    finally:
        await conn.close()
    assert twice == 0
    # Offers whose confirm was lost are offered again: bounded by one tick's budget.
    assert len(pool.received) - 1500 <= 300, len(pool.received)
