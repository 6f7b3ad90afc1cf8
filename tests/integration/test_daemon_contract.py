"""The running daemon against the real PostgreSQL and RabbitMQ: the durable
pause, a real broker nack, and refusals with a Retry-After reported over SQL
and over AMQP. Assertions are on ordering and ledger state (the database's
own timestamps), never on wall-clock margins."""

from __future__ import annotations

import contextlib
import json
import subprocess
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlsplit

import aio_pika
import anyio
import asyncpg
import pytest
from dispatch_helpers import daemon_config, delete_queues, running_daemon, schedule_many, unique

if TYPE_CHECKING:
    import datetime as dt
    from collections.abc import AsyncIterator

    from pacerd.admission import TickResult

pytestmark = [pytest.mark.services, pytest.mark.timeout(120)]


async def _fetch(dsn: str, sql: str, *args: Any) -> list[asyncpg.Record]:
    conn = await asyncpg.connect(dsn)
    try:
        rows: list[asyncpg.Record] = await conn.fetch(sql, *args)
        return rows
    finally:
        await conn.close()


async def _events(dsn: str, destination: str, event: str) -> list[asyncpg.Record]:
    return await _fetch(
        dsn,
        "SELECT e.job_id, e.attempt, e.at, e.detail->>'reason' AS reason FROM pacerd.job_events e"
        " JOIN pacerd.jobs j USING (job_id)"
        " WHERE j.destination = $1 AND e.event = $2 ORDER BY e.id",
        destination,
        event,
    )


async def _until(check: Any, *, within: float = 60) -> None:
    with anyio.fail_after(within):
        while not await check():
            await anyio.sleep(0.05)


def _ticks(ticks: list[TickResult], destination: str) -> list[TickResult]:
    return [t for t in ticks if t.destination == destination]


# ---------------------------------------------------------------------------
# (a) the durable pause
# ---------------------------------------------------------------------------


async def test_durable_pause_holds_every_claim_until_resume(db_dsn: str, amqp_url: str) -> None:
    destination = unique("paused")
    await schedule_many(db_dsn, destination, 20, prefix=destination)
    await _fetch(db_dsn, "SELECT pacerd.pause($1)", destination)
    cfg = daemon_config(db_dsn, amqp_url)
    try:
        async with running_daemon(cfg) as (_daemon, log):

            async def paused_ticks() -> bool:
                return sum(t.skipped == "paused" for t in _ticks(log.ticks, destination)) >= 5

            await _until(paused_ticks)
            before_resume = len(log.ticks)
            claimed_while_paused = await _events(db_dsn, destination, "claimed")
            (resumed,) = await _fetch(
                db_dsn, "SELECT pacerd.resume($1) AS result, now() AS at", destination
            )

            async def all_offered() -> bool:
                return len(await _events(db_dsn, destination, "offered")) == 20

            await _until(all_offered)
    finally:
        await delete_queues(amqp_url, [f"pacerd.ready.{destination}"])

    assert resumed["result"] == "resumed"
    assert claimed_while_paused == []
    assert all(t.claimed == 0 for t in _ticks(log.ticks[:before_resume], destination))
    claims = await _events(db_dsn, destination, "claimed")
    assert len({c["job_id"] for c in claims}) == 20
    assert min(c["at"] for c in claims) >= resumed["at"]


# ---------------------------------------------------------------------------
# (b) a real broker nack
# ---------------------------------------------------------------------------


def _vhost(amqp_url: str) -> str:
    return unquote(urlsplit(amqp_url).path.lstrip("/")) or "/"


def _rabbitmqctl(*args: str) -> None:
    subprocess.run(["rabbitmqctl", "-q", *args], capture_output=True, timeout=60, check=True)


@contextlib.contextmanager
def _rejecting_publishes(amqp_url: str, queue: str) -> Any:
    """A broker policy that holds no message in ``queue`` and nacks every
    publish to it (``max-length`` 0, ``overflow`` reject-publish)."""
    vhost = _vhost(amqp_url)
    if not vhost.startswith("pacerd-test-"):
        pytest.skip("needs this test session's own RabbitMQ virtual host (rabbitmqctl)")
    name = f"nack-{queue}"
    pattern = "^" + queue.replace(".", r"\.") + "$"
    policy = json.dumps({"max-length": 0, "overflow": "reject-publish"})
    _rabbitmqctl("set_policy", "-p", vhost, "--apply-to", "queues", name, pattern, policy)
    try:
        yield
    finally:
        with contextlib.suppress(subprocess.CalledProcessError):
            _rabbitmqctl("clear_policy", "-p", vhost, name)


async def _fill(amqp_url: str, queue: str) -> int:
    """Publishes to ``queue`` (declared as pacerd declares it) until the broker
    nacks a message; returns how many it took first. (A quorum queue takes one
    message past ``max-length`` before it rejects.)"""
    connection = await aio_pika.connect(amqp_url)
    try:
        channel = await connection.channel(publisher_confirms=True)
        await channel.declare_queue(queue, durable=True, arguments={"x-queue-type": "quorum"})
        for taken in range(10):
            try:
                await channel.default_exchange.publish(aio_pika.Message(b"{}"), routing_key=queue)
            except aio_pika.exceptions.DeliveryError:
                return taken
    finally:
        await connection.close()
    raise AssertionError(f"the broker never rejected a publish to {queue}")


async def test_a_broker_nack_releases_the_claim_without_spending_an_attempt(
    db_dsn: str, amqp_url: str
) -> None:
    destination = unique("nacked")
    queue = f"pacerd.ready.{destination}"
    await schedule_many(db_dsn, destination, 5, prefix=destination)
    cfg = daemon_config(db_dsn, amqp_url)
    try:
        with _rejecting_publishes(amqp_url, queue):
            assert await _fill(amqp_url, queue) <= 1
            async with running_daemon(cfg) as (_daemon, _log):

                async def released_again() -> bool:
                    released = await _events(db_dsn, destination, "released")
                    return sum(bool(r["reason"] == "publish_failed") for r in released) >= 10

                await _until(released_again)
            released = await _events(db_dsn, destination, "released")
            offered_while_nacked = await _events(db_dsn, destination, "offered")
            jobs_while_nacked = await _fetch(
                db_dsn,
                "SELECT state, failures FROM pacerd.jobs WHERE destination = $1",
                destination,
            )
        # The policy is gone: the same jobs are offered, still with no attempt spent.
        async with running_daemon(cfg) as (_daemon, _log):

            async def all_offered() -> bool:
                return len(await _events(db_dsn, destination, "offered")) == 5

            await _until(all_offered)
    finally:
        await delete_queues(amqp_url, [queue])

    assert offered_while_nacked == []
    # (a claim the stopping daemon had not published yet is released too)
    assert {r["reason"] for r in released} <= {"publish_failed", "shutdown"}
    assert len({(r["job_id"], r["attempt"]) for r in released}) == len(released)
    assert {r["state"] for r in jobs_while_nacked} == {"scheduled"}
    assert {r["failures"] for r in jobs_while_nacked} == {0}
    jobs = await _fetch(
        db_dsn,
        "SELECT state, failures, attempt FROM pacerd.jobs WHERE destination = $1",
        destination,
    )
    assert {(r["state"], r["failures"]) for r in jobs} == {("offered", 0)}
    assert sum(r["attempt"] for r in jobs) > 10  # every nacked claim took a new attempt number
    assert await _events(db_dsn, destination, "dead") == []


# ---------------------------------------------------------------------------
# (d) refusals with a Retry-After, reported over SQL and over AMQP
# ---------------------------------------------------------------------------

RETRY_AFTER_S = 4.0
OK_BEFORE_REFUSAL = 30


@contextlib.asynccontextmanager
async def _refusing_worker(
    amqp_url: str, dsn: str, routes: dict[str, str]
) -> AsyncIterator[dict[str, dt.datetime]]:
    """Consumes each destination's ready queue and reports ``ok``, except one
    ``refused`` with a Retry-After after ``OK_BEFORE_REFUSAL`` jobs: over SQL
    (``pacerd.report``) or over AMQP (an outcome message), per ``routes``.
    Yields, per destination, when the refusal was sent."""
    refused_at: dict[str, dt.datetime] = {}
    seen = dict.fromkeys(routes, 0)
    one_at_a_time = anyio.Lock()  # one asyncpg connection: one statement at a time
    connection = await aio_pika.connect(amqp_url)
    sql = await asyncpg.connect(dsn)
    try:
        channel = await connection.channel(publisher_confirms=True)
        await channel.set_qos(prefetch_count=50)
        outcomes = await channel.get_exchange("pacerd.outcomes")

        async def on_message(message: aio_pika.abc.AbstractIncomingMessage) -> None:
            job = json.loads(message.body)
            destination = job["destination"]
            seen[destination] += 1
            report: dict[str, Any] = {"job_id": job["job_id"], "attempt": job["attempt"]}
            if seen[destination] == OK_BEFORE_REFUSAL + 1:
                report |= {"outcome": "refused", "retry_after_s": RETRY_AFTER_S}
            else:
                report["outcome"] = "ok"
            if routes[destination] == "sql":
                async with one_at_a_time:
                    row = await sql.fetchrow(
                        "SELECT pacerd.report(job_id => $1, attempt => $2, outcome => $3,"
                        " retry_after_s => $4), now()",
                        report["job_id"],
                        report["attempt"],
                        report["outcome"],
                        report.get("retry_after_s"),
                    )
                assert row is not None
                result, at = row["report"], row["now"]
                assert result in ("applied", "stale"), result
            else:
                async with one_at_a_time:
                    at = await sql.fetchval("SELECT now()")
                await outcomes.publish(
                    aio_pika.Message(json.dumps(report).encode(), delivery_mode=2),
                    routing_key="",
                )
            if report["outcome"] == "refused":
                refused_at[destination] = at
            await message.ack()

        for destination in routes:
            queue = await channel.declare_queue(
                f"pacerd.ready.{destination}", durable=True, arguments={"x-queue-type": "quorum"}
            )
            await queue.consume(on_message)
        yield refused_at
    finally:
        await connection.close()
        await sql.close()


async def test_refusals_with_retry_after_over_sql_and_amqp_cut_the_rate_and_close_the_destination(
    db_dsn: str, amqp_url: str
) -> None:
    routes = {unique("refused-sql"): "sql", unique("refused-amqp"): "amqp"}
    for destination in routes:
        await schedule_many(db_dsn, destination, 400, prefix=destination)
    cfg = daemon_config(db_dsn, amqp_url, PACING__INITIAL_RATE="20", PACING__MAX_RATE="1000")
    try:
        async with (
            running_daemon(cfg) as (_daemon, log),
            _refusing_worker(amqp_url, db_dsn, routes) as refused_at,
        ):

            async def claimed_after_cooldown() -> bool:
                for destination in routes:
                    rows = await _fetch(
                        db_dsn,
                        "SELECT d.cooldown_until, (SELECT max(e.at) FROM pacerd.job_events e"
                        "  JOIN pacerd.jobs j USING (job_id) WHERE j.destination = d.destination"
                        "  AND e.event = 'claimed') AS last_claim"
                        " FROM pacerd.destinations d WHERE d.destination = $1",
                        destination,
                    )
                    row = rows[0]
                    if row["cooldown_until"] is None or row["last_claim"] < row["cooldown_until"]:
                        return False
                return True

            # When each refusal has committed, as the ledger's clock says: any
            # claim that starts later sees the Retry-After.
            seen_at: dict[str, dt.datetime] = {}

            async def refusals_seen() -> bool:
                for destination in routes:
                    if destination not in seen_at and await _events(db_dsn, destination, "refused"):
                        (row,) = await _fetch(db_dsn, "SELECT now() AS now")
                        seen_at[destination] = row["now"]
                return len(seen_at) == len(routes)

            await _until(refusals_seen)
            await _until(claimed_after_cooldown)
    finally:
        await delete_queues(amqp_url, [f"pacerd.ready.{d}" for d in routes])

    for destination in routes:
        (row,) = await _fetch(
            db_dsn,
            "SELECT cooldown_until, n_refused, n_retry_after FROM pacerd.destinations"
            " WHERE destination = $1",
            destination,
        )
        assert (row["n_refused"], row["n_retry_after"]) == (1, 1), destination
        (refusal,) = await _events(db_dsn, destination, "refused")
        assert refused_at[destination] <= refusal["at"] <= seen_at[destination]
        # No claim while the Retry-After runs; claims again once it has passed.
        claims = [c["at"] for c in await _events(db_dsn, destination, "claimed")]
        during = [at for at in claims if seen_at[destination] <= at < row["cooldown_until"]]
        assert during == [], (destination, refusal["at"], seen_at[destination], during)
        assert max(claims) >= row["cooldown_until"]
        # The leader's pacer saw the refusal: the tick that counted it closed
        # the destination, and the first tick after the cool-down runs at a
        # lower rate than the last one before the refusal sent at. In slow
        # start that tick's releases ramp past the rate it began at (and the
        # law reopens under what the ramp had accepted), so what it sent is the
        # higher of its rate and what it claimed over its tick.
        ticks = _ticks(log.ticks, destination)
        first = next(i for i, t in enumerate(ticks) if t.refused > 0)
        assert first > 0
        assert ticks[first].skipped == "cooldown"
        reopened = next(t for t in ticks[first:] if t.skipped is None)
        before = ticks[first - 1]
        sent = max(before.rate, before.claimed / cfg.pacing.tick_seconds)
        assert reopened.rate < sent, (before, reopened)
        assert all(t.claimed == 0 for t in ticks[first:] if t.skipped == "cooldown")
