"""Helpers for the high-availability tests and the failover benchmark:
`pacerd run` instances (``support.daemon``, JSON debug logs), the model upstream
behind the worker library, and the ledger queries that check one budget per
destination whatever happens to the instances.

Leadership is by partition (``pacerd.leadership``): an instance leads
partitions, and the destinations hashed into them. A test that checks
leadership per destination sets the ledger's partitions to the number of its
destinations before any instance starts, and names them so that each falls
into a partition of its own (``names_in_partitions``): one leader per
partition is then one leader per destination, and a takeover of a partition
is the takeover of its one destination."""

from __future__ import annotations

import contextlib
import itertools
import json
import signal
import uuid
from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio
import asyncpg
from support.daemon import Daemon, utcnow
from support.records import TICK_EVENT

from pacerd.leadership import LEADER_NAMESPACE
from pacerd.ledger import Ledger
from pacerd.testing.upstream import CapacitySchedule, ModelUpstream, UpstreamParams
from pacerd.worker import Job, Worker, WorkerApp
from pacerd_demo.app import call_upstream, new_client

if TYPE_CHECKING:
    import datetime as dt
    from collections.abc import AsyncIterator, Iterable, Sequence
    from pathlib import Path


@dataclass(frozen=True, slots=True, kw_only=True)
class Pacing:
    tick_seconds: float = 0.25
    initial_rate: float = 10.0
    min_rate: float = 1.0
    max_rate: float = 200.0
    claim_seconds: float = 2.0
    offer_seconds: float = 60.0
    reconcile_seconds: float = 0.5
    publish_timeout_seconds: float = 10.0


def write_config(
    path: Path, *, dsn: str, amqp_url: str, instance: str, pacing: Pacing, pool_max_size: int = 3
) -> Path:
    path.write_text(
        f"""
[database]
dsn = "{dsn}"
pool_max_size = {pool_max_size}

[broker]
url = "{amqp_url}"
publish_timeout_seconds = {pacing.publish_timeout_seconds}

[pacing]
tick_seconds = {pacing.tick_seconds}
initial_rate = {pacing.initial_rate}
min_rate = {pacing.min_rate}
max_rate = {pacing.max_rate}

[leases]
claim_seconds = {pacing.claim_seconds}
offer_seconds = {pacing.offer_seconds}

[reconcile]
interval_seconds = {pacing.reconcile_seconds}

[daemon]
instance_name = "{instance}"
shutdown_grace_seconds = 5.0

[telemetry]
log_format = "json"
log_level = "debug"
"""
    )
    return path


class Cluster:
    """The instances of one test, on one ledger; stopped at the end."""

    def __init__(self, dir: Path, *, dsn: str, amqp_url: str, pacing: Pacing) -> None:
        self.dir, self.dsn, self.amqp_url, self.pacing = dir, dsn, amqp_url, pacing
        self.instances: dict[str, Daemon] = {}

    def start(self, name: str, *, dsn: str | None = None, amqp_url: str | None = None) -> Daemon:
        config = write_config(
            self.dir / f"{name}.toml",
            dsn=dsn or self.dsn,
            amqp_url=amqp_url or self.amqp_url,
            instance=name,
            pacing=self.pacing,
        )
        instance = Daemon(config, self.dir / f"{name}.log", name=name)
        self.instances[name] = instance
        return instance

    async def stop(self, *, within: float = 20) -> dict[str, int]:
        live = [i for i in self.instances.values() if i.alive]
        for instance in live:
            instance.send(signal.SIGTERM)
        return {i.name: await i.wait_exit(within=within) for i in live}

    def kill_all(self) -> None:
        for instance in self.instances.values():
            instance.close()

    def ticks(self, destination: str) -> list[Tick]:
        out = []
        for instance in self.instances.values():
            for e in instance.events(TICK_EVENT, destination=destination):
                out.append(
                    Tick(
                        by=instance.name,
                        at=e["at"],
                        rate=e["rate"],
                        budget=e["budget"],
                        claimed=e["claimed"],
                    )
                )
        return sorted(out, key=lambda t: t.at)


@dataclass(frozen=True, slots=True)
class Tick:
    """One `tick_completed` log line (written at the end of the tick)."""

    by: str
    at: dt.datetime
    rate: float
    budget: int
    claimed: int


@dataclass(frozen=True, slots=True)
class ClaimGroup:
    """The jobs one tick claimed: one claim statement, so one `at`."""

    destination: str
    by: str
    at: dt.datetime
    n: int


async def claim_groups(dsn: str, destination: str | None = None) -> list[ClaimGroup]:
    conn = await asyncpg.connect(dsn)
    try:
        rows = await conn.fetch(
            "SELECT j.destination, e.detail->>'by' AS by, e.at, count(*) AS n"
            " FROM pacerd.job_events e JOIN pacerd.jobs j USING (job_id)"
            " WHERE e.event = 'claimed' AND ($1::text IS NULL OR j.destination = $1)"
            " GROUP BY 1, 2, 3 ORDER BY e.at",
            destination,
        )
    finally:
        await conn.close()
    return [ClaimGroup(r["destination"], r["by"], r["at"], r["n"]) for r in rows]


async def first_claim_after(
    dsn: str,
    destination: str,
    after: dt.datetime,
    *,
    within: float,
    not_by: str | None = None,
    by: str | None = None,
) -> ClaimGroup:
    with anyio.fail_after(within):
        while True:
            for group in await claim_groups(dsn, destination):
                if group.at > after and group.by != not_by and by in (None, group.by):
                    return group
            await anyio.sleep(0.05)


async def takeover_from(
    dsn: str, destination: str, killed: dt.datetime, *, old: str, within: float
) -> tuple[ClaimGroup, float]:
    """The first claim of ``destination`` after ``killed`` by another instance
    than ``old`` (the new leader's), and the rate that ``old`` left persisted
    for it: the last pacer state saved by ``old``, read until the new leader
    claims (it saves only at the end of that tick). Its last tick record is
    not that rate when the kill fell between the tick's save and its record."""
    saved: float | None = None
    conn = await asyncpg.connect(dsn)
    try:
        with anyio.fail_after(within):
            while True:
                state = await conn.fetchval(
                    "SELECT pacer_state FROM pacerd.destinations WHERE destination = $1",
                    destination,
                )
                persisted = json.loads(state) if state is not None else {}
                if persisted.get("tick", {}).get("by") == old:
                    saved = float(persisted["pacer"]["rate"])
                for group in await claim_groups(dsn, destination):
                    if group.at > killed and group.by != old:
                        assert saved is not None, f"{old} left no pacer state of {destination}"
                        return group, saved
                await anyio.sleep(0.05)
    finally:
        await conn.close()


async def next_acquisition(
    instances: Iterable[Daemon], partition: int, *, after: dt.datetime, within: float
) -> tuple[Daemon, dict[str, Any]]:
    """The first instance to acquire ``partition`` after ``after``, and its record."""
    with anyio.fail_after(within):
        while True:
            found = [
                (e["at"], i.name, i, e)
                for i in instances
                for e in i.events("leadership_acquired", partition=partition)
                if e["at"] > after
            ]
            if found:
                _at, _name, instance, record = min(found, key=lambda f: (f[0], f[1]))
                return instance, record
            await anyio.sleep(0.05)


def acquisition(instance: Daemon, partition: int, *, after: dt.datetime) -> dict[str, Any]:
    """The first `leadership_acquired` record of ``partition`` by ``instance`` after ``after``."""
    found = instance.events("leadership_acquired", partition=partition)
    later = [e for e in found if e["at"] > after]
    assert later, f"{instance.name} never acquired partition {partition} after {after}: {found}"
    return later[0]


def passes_before(instance: Daemon, acquired: dict[str, Any], *, after: dt.datetime) -> int:
    """How many supervisor passes ``instance`` began after ``after`` (a kill, a
    cut) and before the pass that logged ``acquired``: the daemon's own count,
    not a wall-clock margin. A standby takes a freed lock on its next pass, so
    this is 0, or 1 when that pass began before the server had noticed the
    dead session and freed the lock. The count needs the daemon's record of
    each pass (`supervisor_pass`, docs/ha.md): without any, it would be 0 for
    every takeover, however late."""
    n = acquired["supervisor_pass"]
    passes = instance.events("supervisor_pass")
    assert passes, (
        f"{instance.name} logged no `supervisor_pass` record: its passes cannot be counted"
    )
    assert any(e["supervisor_pass"] >= n for e in passes), (
        f"{instance.name} logged no `supervisor_pass` record for its pass {n} ({acquired})"
    )
    return sum(1 for e in passes if e["at"] > after and e["supervisor_pass"] < n)


def handoffs(groups: Sequence[ClaimGroup]) -> list[tuple[ClaimGroup, ClaimGroup]]:
    """Consecutive claim groups of one destination by different instances."""
    by_destination: dict[str, list[ClaimGroup]] = defaultdict(list)
    for g in groups:
        by_destination[g.destination].append(g)
    out = []
    for seq in by_destination.values():
        seq.sort(key=lambda g: g.at)
        out += [(a, b) for a, b in itertools.pairwise(seq) if a.by != b.by]
    return out


def assert_one_leader_at_a_time(groups: Sequence[ClaimGroup], tick_seconds: float) -> None:
    """A new leader's first claim comes at least one tick after the previous
    leader's last one, so no tick-long window holds claims of two instances:
    the upstream sees one budget per destination."""
    for a, b in handoffs(groups):
        gap = (b.at - a.at).total_seconds()
        assert gap >= tick_seconds - 0.005, f"two leaders within one tick: {a} then {b}"


def assert_claims_within_budgets(
    groups: Sequence[ClaimGroup],
    cluster: Cluster,
    destination: str,
    *,
    cut_short: dict[str, list[dt.datetime]] | None = None,
) -> list[tuple[ClaimGroup, Tick | None]]:
    """Matches every claim group of ``destination`` with the tick that made it
    (the instance's next `tick_completed` line) and checks claimed <= budget.
    A group with no log line is allowed only as the last claim of an
    instance before it was killed or lost its leadership (``cut_short``:
    instance -> times); returns the pairs."""
    ticks = [t for t in cluster.ticks(destination) if t.claimed > 0]
    pairs: list[tuple[ClaimGroup, Tick | None]] = []
    for instance in {g.by for g in groups if g.destination == destination}:
        mine = [g for g in groups if g.destination == destination and g.by == instance]
        logged = [t for t in ticks if t.by == instance]
        ends = sorted((cut_short or {}).get(instance, []))
        for i, group in enumerate(mine):
            following = mine[i + 1].at if i + 1 < len(mine) else None
            tick = next(
                (t for t in logged if t.at >= group.at and (following is None or t.at < following)),
                None,
            )
            if tick is None:
                end = next((e for e in ends if e >= group.at), None)
                why = f"{group}: its tick never completed, yet its instance went on leading"
                assert end is not None, why
                assert following is None or following > end, why
            else:
                assert tick.claimed == group.n, (group, tick)
                assert group.n <= tick.budget, (group, tick)
            pairs.append((group, tick))
    return pairs


async def lock_holder_pid(dsn: str, name: str) -> int | None:
    """The backend holding the leadership lock of ``name`` (a partition's:
    ``pacerd.leadership.partition_lock``)."""
    conn = await asyncpg.connect(dsn)
    try:
        pid: int | None = await conn.fetchval(
            "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted"
            " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
            " AND classid = $1 AND objid = (hashtext($2)::bigint & 4294967295)::oid"
            " AND objsubid = 2",
            LEADER_NAMESPACE,
            name,
        )
        return pid
    finally:
        await conn.close()


async def leaders(dsn: str) -> dict[str, tuple[str | None, dt.datetime | None]]:
    """Who leads each destination, and since when: the leader its partition
    records (``pacerd.partitions``), as `pacerd status` shows it."""
    conn = await asyncpg.connect(dsn)
    try:
        rows = await conn.fetch(
            "SELECT d.destination, p.leader, p.leader_since FROM pacerd.destinations d"
            " LEFT JOIN pacerd.partitions p ON p.partition = d.partition"
        )
    finally:
        await conn.close()
    return {r["destination"]: (r["leader"], r["leader_since"]) for r in rows}


async def set_partitions(dsn: str, partitions: int) -> None:
    """Sets how many partitions the ledger's destinations hash into (refused
    while an instance runs on it: set it before starting any)."""
    led = await Ledger.connect(dsn, max_size=1)
    try:
        await led.set_partitions(partitions)
        assert await led.read_partitions() == partitions
    finally:
        await led.close()


async def names_in_partitions(dsn: str, prefix: str, n: int) -> list[str]:
    """Sets the ledger's partitions to ``n`` and returns ``n`` destination
    names, the i-th in partition i (``pacerd._partition_of``, the hash the
    ledger places destinations with), drawn as ``<prefix>-<random hex>``."""
    await set_partitions(dsn, n)
    found: dict[int, str] = {}
    conn = await asyncpg.connect(dsn)
    try:
        while len(found) < n:
            candidates = [f"{prefix}-{uuid.uuid4().hex[:8]}" for _ in range(4 * n)]
            rows = await conn.fetch(
                "SELECT c.name, pacerd._partition_of(c.name, $2) AS partition"
                " FROM unnest($1::text[]) AS c(name)",
                candidates,
                n,
            )
            for r in rows:
                found.setdefault(r["partition"], r["name"])
    finally:
        await conn.close()
    return [found[p] for p in range(n)]


async def partitions_of(dsn: str, destinations: Iterable[str]) -> dict[str, int]:
    """The partition the ledger stored for each of ``destinations`` (each must exist)."""
    names = list(destinations)
    conn = await asyncpg.connect(dsn)
    try:
        rows = await conn.fetch(
            "SELECT destination, partition FROM pacerd.destinations"
            " WHERE destination = ANY ($1::text[])",
            names,
        )
    finally:
        await conn.close()
    placed = {r["destination"]: r["partition"] for r in rows}
    assert set(placed) == set(names), f"unknown destinations: {set(names) - set(placed)}"
    return placed


async def schedule_backlog(dsn: str, destination: str, n: int) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(
            "SELECT pacerd.schedule(job_id => $1 || '-' || g, kind => 'ha', destination => $1,"
            " payload => jsonb_build_object('n', g), eligible_at => now() - interval '1 minute')"
            " FROM generate_series(1, $2) g",
            destination,
            n,
        )
    finally:
        await conn.close()


async def state_counts(dsn: str) -> dict[str, int]:
    conn = await asyncpg.connect(dsn)
    try:
        rows = await conn.fetch("SELECT state, count(*) AS n FROM pacerd.jobs GROUP BY state")
    finally:
        await conn.close()
    return {r["state"]: r["n"] for r in rows}


async def wait_completed(dsn: str, total: int, *, within: float) -> None:
    with anyio.fail_after(within):
        while (await state_counts(dsn)).get("completed", 0) < total:
            await anyio.sleep(0.25)


async def assert_completed_exactly_once(dsn: str, total: int) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        states = await conn.fetch("SELECT state, count(*) AS n FROM pacerd.jobs GROUP BY state")
        twice = await conn.fetchval(
            "SELECT count(*) FROM (SELECT job_id FROM pacerd.job_events"
            " WHERE event = 'completed' GROUP BY job_id HAVING count(*) > 1) s"
        )
    finally:
        await conn.close()
    assert {r["state"]: r["n"] for r in states} == {"completed": total}
    assert twice == 0, "a job was completed twice"


@dataclass
class Upstreams:
    """One model upstream per destination, called by the worker library; it
    records when each offer (job_id, attempt) reached a worker."""

    servers: dict[str, ModelUpstream] = field(default_factory=dict)
    received: dict[tuple[str, int], dt.datetime] = field(default_factory=dict)
    worker: Worker | None = None

    def duplicates(self) -> int:
        return sum(s.model.duplicates for s in self.servers.values())


@contextlib.asynccontextmanager
async def upstream_workers(
    amqp_url: str, destinations: Iterable[str], *, capacity: float, prefetch: int = 32
) -> AsyncIterator[Upstreams]:
    ups = Upstreams()
    names = list(destinations)
    try:
        for name in names:
            server = ModelUpstream(UpstreamParams(schedule=CapacitySchedule.parse(f"0:{capacity}")))
            await server.start()
            ups.servers[name] = server
        urls = {name: server.url for name, server in ups.servers.items()}
        app = WorkerApp(destinations=names, prefetch=prefetch, check_current=False)
        http = new_client(max_connections=prefetch * len(names))

        @app.handler()
        async def call(job: Job) -> dict[str, Any]:
            ups.received.setdefault((job.job_id, job.attempt), utcnow())
            return await call_upstream(http, urls[job.destination], job)

        ups.worker = Worker(app, broker_url=amqp_url)
        async with http, anyio.create_task_group() as tg:
            await tg.start(ups.worker.run)
            try:
                yield ups
            finally:
                ups.worker.request_stop()
    finally:
        for server in ups.servers.values():
            await server.close()


@contextlib.asynccontextmanager
async def ok_workers(
    amqp_url: str, destinations: Iterable[str], *, prefetch: int = 100
) -> AsyncIterator[Upstreams]:
    """A plain AMQP worker pool reporting `ok` for every offer (cheaper than
    the worker library and the model upstream); records receipt times."""
    import aio_pika

    ups = Upstreams()
    connection = await aio_pika.connect_robust(amqp_url)
    try:
        channel = await connection.channel(publisher_confirms=True)
        await channel.set_qos(prefetch_count=prefetch)
        outcomes = await channel.declare_exchange(
            "pacerd.outcomes", aio_pika.ExchangeType.FANOUT, durable=True
        )

        async def on_message(message: aio_pika.abc.AbstractIncomingMessage) -> None:
            job = json.loads(message.body)
            ups.received.setdefault((job["job_id"], job["attempt"]), utcnow())
            report = {"job_id": job["job_id"], "attempt": job["attempt"], "outcome": "ok"}
            await outcomes.publish(
                aio_pika.Message(json.dumps(report).encode(), delivery_mode=2), routing_key=""
            )
            await message.ack()

        for name in destinations:
            queue = await channel.declare_queue(
                f"pacerd.ready.{name}", durable=True, arguments={"x-queue-type": "quorum"}
            )
            await queue.consume(on_message)
        yield ups
    finally:
        await connection.close()


async def delete_queues(amqp_url: str, destinations: Iterable[str]) -> None:
    import aio_pika

    connection = await aio_pika.connect(amqp_url)
    try:
        for name in destinations:
            channel = await connection.channel()
            with contextlib.suppress(Exception):
                await channel.queue_delete(f"pacerd.ready.{name}")
    finally:
        await connection.close()
