"""Helpers for tests that run the daemon in-process against the real services:
a config for a test database, a minimal AMQP worker pool, ledger queries."""

from __future__ import annotations

import contextlib
import json
import subprocess
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import aio_pika
import anyio
import asyncpg

from pacerd.config import Config, load_config
from pacerd.daemon import Daemon

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable, Mapping

    from pacerd.admission import TickResult
    from pacerd.telemetry import Telemetry


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def daemon_config(dsn: str, amqp_url: str, **overrides: Any) -> Config:
    env = {
        "PACERD_DATABASE__DSN": dsn,
        "PACERD_BROKER__URL": amqp_url,
        "PACERD_PACING__TICK_SECONDS": "0.2",
        "PACERD_PACING__INITIAL_RATE": "200",
        "PACERD_PACING__MAX_RATE": "5000",
        "PACERD_LEASES__CLAIM_SECONDS": "10",
        "PACERD_LEASES__OFFER_SECONDS": "30",
        "PACERD_RECONCILE__INTERVAL_SECONDS": "0.5",
        "PACERD_DAEMON__SHUTDOWN_GRACE_SECONDS": "5",
        "PACERD_TELEMETRY__LOG_LEVEL": "warning",
    }
    env.update({f"PACERD_{k.upper()}": str(v) for k, v in overrides.items()})
    return load_config(None, env)


@dataclass
class TickLog:
    """Every tick result the daemon produced, by destination."""

    ticks: list[TickResult] = field(default_factory=list)

    def install(self, daemon: Daemon) -> None:
        original = daemon.observer.tick_completed

        def record(result: TickResult) -> None:
            self.ticks.append(result)
            original(result)

        daemon.observer.tick_completed = record  # type: ignore[method-assign]


@contextlib.asynccontextmanager
async def running_daemon(
    cfg: Config, *, telemetry: Telemetry | None = None
) -> AsyncIterator[tuple[Daemon, TickLog]]:
    daemon = Daemon(cfg, config_path=None, signals=False, telemetry=telemetry)
    ticks = TickLog()
    ticks.install(daemon)
    async with anyio.create_task_group() as tg:
        codes: list[int] = []

        async def run() -> None:
            codes.append(await daemon.run())

        tg.start_soon(run)
        with anyio.fail_after(30):
            await daemon.ready_event.wait()
        try:
            yield daemon, ticks
        finally:
            daemon.request_stop()
    assert codes == [0]


@dataclass
class WorkerPool:
    """Consumes ready queues and reports an outcome for each message."""

    received: list[dict[str, Any]] = field(default_factory=list)
    message_ids: Counter[str] = field(default_factory=Counter)
    decide: Callable[[dict[str, Any]], Mapping[str, Any]] = lambda _job: {"outcome": "ok"}


@contextlib.asynccontextmanager
async def worker_pool(
    amqp_url: str, queues: list[str], pool: WorkerPool, *, prefetch: int = 200
) -> AsyncIterator[WorkerPool]:
    connection = await aio_pika.connect_robust(amqp_url)
    try:
        channel = await connection.channel(publisher_confirms=True)
        await channel.set_qos(prefetch_count=prefetch)
        outcomes = await channel.get_exchange("pacerd.outcomes")

        async def on_message(message: aio_pika.abc.AbstractIncomingMessage) -> None:
            job = json.loads(message.body)
            pool.received.append(job)
            pool.message_ids[message.message_id or ""] += 1
            report = {"job_id": job["job_id"], "attempt": job["attempt"], **pool.decide(job)}
            await outcomes.publish(
                aio_pika.Message(json.dumps(report).encode(), delivery_mode=2), routing_key=""
            )
            await message.ack()

        for name in queues:
            queue = await channel.declare_queue(
                name, durable=True, arguments={"x-queue-type": "quorum"}
            )
            await queue.consume(on_message)
        yield pool
    finally:
        await connection.close()


async def purge_outcomes(amqp_url: str) -> None:
    connection = await aio_pika.connect(amqp_url)
    try:
        channel = await connection.channel()
        with contextlib.suppress(aio_pika.exceptions.ChannelNotFoundEntity):
            queue = await channel.get_queue("pacerd.outcomes", ensure=True)
            await queue.purge()
    finally:
        await connection.close()


async def delete_queues(amqp_url: str, names: list[str]) -> None:
    connection = await aio_pika.connect(amqp_url)
    try:
        for name in names:
            channel = await connection.channel()
            with contextlib.suppress(Exception):
                await channel.queue_delete(name)
    finally:
        await connection.close()


async def state_counts(dsn: str) -> dict[str, int]:
    conn = await asyncpg.connect(dsn)
    try:
        rows = await conn.fetch("SELECT state, count(*) AS n FROM pacerd.jobs GROUP BY state")
        return {r["state"]: r["n"] for r in rows}
    finally:
        await conn.close()


async def wait_for_states(
    dsn: str, predicate: Callable[[dict[str, int]], bool], *, within: float
) -> dict[str, int]:
    with anyio.fail_after(within):
        while True:
            counts = await state_counts(dsn)
            if predicate(counts):
                return counts
            await anyio.sleep(0.2)


async def schedule_many(
    dsn: str, destination: str, n: int, *, prefix: str, eligible_in_seconds: float = -60
) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(
            "SELECT pacerd.schedule(job_id => $1 || '-' || g, kind => 'test',"
            " destination => $2, payload => jsonb_build_object('n', g),"
            " eligible_at => now() + make_interval(secs => $3))"
            " FROM generate_series(1, $4) g",
            prefix,
            destination,
            eligible_in_seconds,
            n,
        )
    finally:
        await conn.close()


def close_broker_connections(name_prefix: str) -> int:
    """Cuts the broker connections whose client-given name starts with
    ``name_prefix`` (as a network fault would); returns how many."""
    listing = subprocess.run(
        ["rabbitmqctl", "-q", "list_connections", "pid", "client_properties", "--no-table-headers"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    cut = 0
    for line in listing.splitlines():
        pid, _, properties = line.partition("\t")
        if f'{{"connection_name","{name_prefix}' in properties:
            subprocess.run(
                ["rabbitmqctl", "-q", "close_connection", pid.strip(), "test fault"],
                capture_output=True,
                timeout=60,
                check=False,
            )
            cut += 1
    return cut
