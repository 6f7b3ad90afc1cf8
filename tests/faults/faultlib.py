"""The fault-injection harness: runs ``pacerd run``, ``pacerd worker`` (with
``faultapp``) and the model upstream against the real PostgreSQL and RabbitMQ,
lets a scenario inject faults, then audits the ledger, the workers' call logs,
the daemons' tick logs and the upstream's record of idempotency keys.

It reuses the project's pieces: ``pacerd.testing.upstream.ModelUpstream`` (the
rate-limited upstream that records each accepted call's key),
``pacerd_demo.app`` (through ``faultapp``), the SQL API for the
workload, the CLI verbs as an operator runs them. Both the fast tests
(``tests/faults``) and the full benchmark (``bench/faults/run.py``) drive it.

    async with Rig(dsn=..., amqp_url=..., workdir=..., destination="faults-x") as rig:
        await rig.schedule(1000)
        pacerd = await rig.start_pacerd()
        await rig.start_workers(2)
        ...                                   # faults, recorded with rig.fault(...)
        audit = await rig.audit(within=30)   # waits for the drain to settle, then audits
        assert audit.violations() == []

What the audit checks (``Audit.violations``): no job lost (every job is
completed, dead with a reason, or scheduled for later; none missing, stuck or
completed without its side effect); no side effect executed twice (no key
accepted again after its job completed; no superseded revision executed);
duplicate offers within the scenario's bound; no tick claimed above its
budget and no one-second window above the rate's allowance; the upstream never
saw more calls in a second than its capacity and burst; every pacerd that
should run answers ``/healthz``.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import functools
import itertools
import json
import math
import os
import shutil
import subprocess
import time
import uuid
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlsplit

import aio_pika
import anyio
import anyio.to_thread
import asyncpg
import httpx
from support.daemon import Daemon, free_port
from support.proxy import FaultProxy
from support.records import TICK_EVENT, records
from support.services import ADMIN_DSN, amqp_url_for, dsn_for, with_port, with_user

from pacerd import ledger
from pacerd.publisher import INVALID_QUEUE, OUTCOMES_QUEUE, ready_queue_name
from pacerd.roles import DAEMON_BROKER_PERMISSIONS, RoleNames, worker_broker_permissions
from pacerd.testing.upstream import CapacitySchedule, ModelUpstream, UpstreamParams

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence

    from anyio.abc import TaskGroup

FAULTS_DIR = Path(__file__).resolve().parent
HARNESS_APP = "pacerd-fault-harness"

# AMQP basic.publish to the `pacerd.ready` exchange: class 60, method 40, a
# reserved short, then the exchange name as a short string.
PUBLISH_FRAME = b"\x00\x3c\x00\x28\x00\x00\x0cpacerd.ready"
# What the harness's own statements may meet while PostgreSQL restarts (a pooled
# connection caught mid-statement by the restart can report an internal client
# error instead of a closed one, as the daemon's ledger code expects too).
DB_DOWN = (
    OSError,
    asyncpg.PostgresError,
    asyncpg.InterfaceError,
    asyncpg.InternalClientError,
    TimeoutError,
)


# -- configuration ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Knobs:
    """The pacerd config a scenario runs with (short ticks and leases)."""

    tick_seconds: float = 0.2
    initial_rate: float = 100.0
    min_rate: float = 10.0
    max_rate: float = 300.0
    increase_step: float = 20.0
    max_inflight: int = 400
    claim_seconds: float = 2.0
    offer_seconds: float = 15.0
    reconcile_seconds: float = 0.5
    publish_timeout_seconds: float = 2.0
    max_attempts: int = 10
    backoff_base_seconds: float = 0.2
    backoff_cap_seconds: float = 1.0
    shutdown_grace_seconds: float = 3.0
    connect_timeout_seconds: float = 3.0
    pool_max_size: int = 8


def config_toml(
    knobs: Knobs, *, dsn: str, amqp_url: str, http_port: int | None, log_level: str = "debug"
) -> str:
    k = knobs
    http = f"127.0.0.1:{http_port}" if http_port else ""
    return f"""
[database]
dsn = "{dsn}"
pool_max_size = {k.pool_max_size}
connect_timeout_seconds = {k.connect_timeout_seconds}

[broker]
url = "{amqp_url}"
publish_timeout_seconds = {k.publish_timeout_seconds}

[pacing]
tick_seconds = {k.tick_seconds}
initial_rate = {k.initial_rate}
min_rate = {k.min_rate}
max_rate = {k.max_rate}
increase_step = {k.increase_step}
max_inflight = {k.max_inflight}

[leases]
claim_seconds = {k.claim_seconds}
offer_seconds = {k.offer_seconds}

[retry]
max_attempts = {k.max_attempts}
backoff_base_seconds = {k.backoff_base_seconds}
backoff_cap_seconds = {k.backoff_cap_seconds}

[reconcile]
interval_seconds = {k.reconcile_seconds}

[daemon]
shutdown_grace_seconds = {k.shutdown_grace_seconds}

[telemetry]
log_format = "json"
log_level = "{log_level}"
http_address = "{http}"
"""


# -- services (the bench creates its own database and vhost) ------------------------------


def rabbitmqctl(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["rabbitmqctl", "-q", *args], capture_output=True, text=True, timeout=timeout, check=False
    )


# The broker's own functions behind `rabbitmqctl add_user`, `set_permissions`
# and `delete_user`, called in one `rabbitmqctl eval`: each rabbitmqctl call
# starts an Erlang VM (about a second of CPU), and a rig adds, permits and
# deletes two users. Arguments go as byte lists, beyond any quoting.
_BROKER_CALLS = {
    "add_user": "rabbit_auth_backend_internal:add_user({0}, {1}, {actor})",
    # set_permissions -p VHOST USER CONFIGURE WRITE READ
    "set_permissions": (
        "rabbit_auth_backend_internal:set_permissions({2}, {1}, {3}, {4}, {5}, {actor})"
    ),
    "delete_user": "rabbit_auth_backend_internal:delete_user({0}, {actor})",
}


def _erlang_binary(text: str) -> str:
    return "<<" + ",".join(str(byte) for byte in text.encode()) + ">>"


def broker_user_commands(*commands: tuple[str, ...], check: bool = True) -> None:
    """Runs rabbitmqctl's ``add_user U P``, ``set_permissions -p V U C W R`` and
    ``delete_user U`` commands, in order, in one call. Where that call fails
    (another broker version), each runs as its own rabbitmqctl call, as it
    would have; ``check``: a command that fails raises."""
    steps = []
    for i, command in enumerate(commands):
        name, *args = command
        binaries = [_erlang_binary(arg) for arg in args]
        steps.append(
            f"R{i} = " + _BROKER_CALLS[name].format(*binaries, actor=_erlang_binary("pacerd-tests"))
        )
    results = ", ".join(f"R{i}" for i in range(len(commands)))
    done = rabbitmqctl("eval", f"{', '.join(steps)}, [{results}].")
    if done.returncode == 0 and done.stdout.strip() == f"[{','.join(['ok'] * len(commands))}]":
        return
    if not check:  # deletions: what the call did not do, one at a time
        for command in commands:
            rabbitmqctl(*command)
        return
    for command in commands:  # undo whatever part was done, then one at a time
        if command[0] == "add_user":
            rabbitmqctl("delete_user", command[1])
    for command in commands:
        one = rabbitmqctl(*command)
        if one.returncode != 0:
            raise RuntimeError(f"rabbitmqctl {' '.join(command[:2])}: {one.stderr.strip()}")


async def create_database(name: str) -> str:
    conn = await asyncpg.connect(ADMIN_DSN)
    try:
        await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await conn.execute(f'CREATE DATABASE "{name}"')
    finally:
        await conn.close()
    await ledger.migrate(dsn_for(name))
    return dsn_for(name)


async def drop_database(name: str) -> None:
    conn = await asyncpg.connect(ADMIN_DSN)
    try:
        await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await conn.close()


async def create_vhost(vhost: str) -> str:
    """A RabbitMQ vhost of the run's own, so no other pacerd consumes its outcomes."""
    for args in (["add_vhost", vhost], ["set_permissions", "-p", vhost, "guest", ".*", ".*", ".*"]):
        done = await anyio.to_thread.run_sync(rabbitmqctl, *args)
        if done.returncode != 0 and "already_exists" not in done.stderr:
            raise RuntimeError(f"rabbitmqctl {' '.join(args)}: {done.stderr.strip()}")
    return amqp_url_for(vhost)


async def delete_vhost(vhost: str) -> None:
    await anyio.to_thread.run_sync(lambda: rabbitmqctl("delete_vhost", vhost))


# -- processes -------------------------------------------------------------------------


class PacerdProc(Daemon):
    """A ``pacerd run`` of the rig, with its HTTP port."""

    def __init__(
        self, name: str, config: Path, env: Mapping[str, str], log: Path, port: int, proxied: bool
    ) -> None:
        super().__init__(config, log, name=name, env=env, new_session=True)
        self.http_port, self.proxied = port, proxied

    async def healthz(self) -> int:
        """The status of ``GET /healthz`` (0 when it does not answer)."""
        try:
            async with httpx.AsyncClient(timeout=3.0) as client:
                response = await client.get(f"http://127.0.0.1:{self.http_port}/healthz")
        except httpx.TransportError:
            return 0
        return response.status_code


class WorkerProc(Daemon):
    """A ``pacerd worker --app faultapp:app`` of the rig, with its call log."""

    def __init__(self, name: str, config: Path, env: Mapping[str, str], log: Path, calls: Path):
        pythonpath = [str(FAULTS_DIR), *filter(None, [os.environ.get("PYTHONPATH")])]
        super().__init__(
            config, log, name=name, command=("worker", "--app", "faultapp:app"),
            env={**env, "PYTHONPATH": os.pathsep.join(pythonpath)}, new_session=True,
        )  # fmt: skip
        self.calls = calls


# -- faults ----------------------------------------------------------------------------


@dataclass(slots=True)
class Fault:
    kind: str
    started: float  # wall-clock seconds
    ended: float | None = None
    detail: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True, kw_only=True)
class Bounds:
    """What a scenario allows (duplicate offers are bounded, not zero)."""

    dup_offers: int = 0
    refusals: int = 0  # upstream refusals (calls beyond its capacity and burst)
    must_complete: bool = True  # every job completed (no dead expected)
    crashes_allowed: int = 0  # pacerd exits on its own (a known bug, named where allowed)


# -- the audit ---------------------------------------------------------------------------


@dataclass(slots=True)
class Audit:
    scenario: str
    jobs: int
    faults: list[Fault]
    states: dict[str, int]
    missing: int
    stuck: int  # claimed or offered after the drain settled
    due_left: int  # due and scheduled after the drain settled (pacerd stopped admitting)
    future: int  # scheduled for later (legitimately waiting)
    dead: int
    dead_without_reason: int
    completed_without_effect: int
    replays: int  # upstream calls repeating a key before its job completed (absorbed by the key)
    dup_effects: int  # keys accepted again after their job completed
    superseded_executed: int
    dup_offers: int
    deliveries: int
    max_over_budget: int  # claimed - budget, per tick (logs), and per 1 s window (ledger)
    ticks_logged: int
    claim_groups: int
    upstream_capacity: float
    upstream_peak: int  # most calls the upstream saw in one second
    upstream_refused: int
    recovery_seconds: float | None
    unhealthy: list[str]
    crashes: list[str]  # pacerd exits the harness restarted, as systemd would
    bounds: Bounds
    notes: list[str] = field(default_factory=list)
    elapsed_seconds: float = 0.0
    # Who the parties connected as: ledger session users and broker connection users
    # seen (the harness's own excepted), when the rig ran each party on its role.
    identities: dict[str, list[str]] = field(default_factory=dict)

    @property
    def lost(self) -> int:
        """Jobs gone from the ledger, closed without a reason, or completed without
        their effect (a job still due or in flight is late, not lost)."""
        return self.missing + self.dead_without_reason + self.completed_without_effect

    def violations(self) -> list[str]:
        v = []
        if self.lost:
            v.append(
                f"lost {self.lost}: missing {self.missing}, dead without reason"
                f" {self.dead_without_reason}, completed without effect"
                f" {self.completed_without_effect} ({self.states})"
            )
        if self.stuck or self.due_left:
            v.append(
                f"not drained in time: {self.due_left} due, {self.stuck} claimed or offered"
                f" ({self.states})"
            )
        if self.bounds.must_complete and self.states.get("completed", 0) + self.future < self.jobs:
            v.append(f"not every job completed: {self.states}")
        if self.dup_effects:
            v.append(f"{self.dup_effects} side effects executed again after completion")
        if self.superseded_executed:
            v.append(f"{self.superseded_executed} superseded revisions executed")
        if self.dup_offers > self.bounds.dup_offers:
            v.append(f"duplicate offers {self.dup_offers} > bound {self.bounds.dup_offers}")
        if self.max_over_budget > 0:
            v.append(f"admitted above budget by {self.max_over_budget}")
        if self.upstream_refused > self.bounds.refusals:
            v.append(
                f"the upstream refused {self.upstream_refused} calls (more than its capacity"
                f" {self.upstream_capacity:.0f}/s and burst; allowed {self.bounds.refusals})"
            )
        if self.unhealthy:
            v.append(f"unhealthy: {self.unhealthy}")
        if len(self.crashes) > self.bounds.crashes_allowed:
            v.append(f"crashed (restarted by the harness, as systemd would): {self.crashes}")
        v += [n.removeprefix("VIOLATION: ") for n in self.notes if n.startswith("VIOLATION: ")]
        return v

    def fault_summary(self) -> str:
        kinds = Counter(f.kind for f in self.faults)
        return ", ".join(f"{n}× {k}" for k, n in kinds.items()) or "none"

    def row(self) -> dict[str, str]:
        return {
            "scenario": self.scenario,
            "jobs": f"{self.jobs:,}",
            "faults injected": self.fault_summary(),
            "lost": str(self.lost),
            "duplicate effects": str(self.dup_effects + self.superseded_executed),
            "replayed calls": str(self.replays),
            "duplicate offers": str(self.dup_offers),
            "max over-budget": str(self.max_over_budget),
            "upstream peak/s (cap, refused)": (
                f"{self.upstream_peak} ({self.upstream_capacity:.0f}, {self.upstream_refused})"
            ),
            "crashes": str(len(self.crashes)),
            "recovery time": "-"
            if self.recovery_seconds is None
            else f"{self.recovery_seconds:.1f} s",
            "result": "pass" if not self.violations() else "FAIL",
        }


def markdown_table(rows: Sequence[Mapping[str, str]]) -> str:
    if not rows:
        return ""
    columns = list(rows[0])
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(r[c] for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def _epoch(value: dt.datetime) -> float:
    return value.timestamp()


# -- who each party runs as -------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Identities:
    """One scenario's own login roles and broker users, each party on the least
    it needs (``pacerd.roles``): the daemon on a LOGIN role that owns the
    scenario's ledger (it migrates it, as ``pacerd migrate`` runs in
    production), workers on a member of the worker role, the workload on a
    member of the producer role, operator calls on a member of the operator
    role; on the broker, a daemon user and a worker user with the minimal
    permissions in the scenario's vhost. The harness's own connections (the
    audit, ``pg_terminate_backend``, queue set-up, bad input) stay on the
    administrator and guest."""

    owner: str
    worker: str
    producer: str
    operator: str
    daemon_user: str
    worker_user: str
    password: str

    @classmethod
    def fresh(cls) -> Identities:
        tag = uuid.uuid4().hex[:10]
        return cls(
            owner=f"pacerd_fo_{tag}", worker=f"pacerd_fw_{tag}", producer=f"pacerd_fp_{tag}",
            operator=f"pacerd_fa_{tag}", daemon_user=f"pacerd-fd-{tag}",
            worker_user=f"pacerd-fw-{tag}", password=uuid.uuid4().hex,
        )  # fmt: skip

    @property
    def roles(self) -> tuple[str, ...]:
        return (self.owner, self.worker, self.producer, self.operator)

    async def create(self, dsn: str, amqp_url: str, destination: str) -> None:
        """Creates the roles and users, hands the ledger's database to the owner
        and migrates it as the owner (the schema a template left is dropped
        first). ``drop`` undoes whatever part of it was done."""
        names = RoleNames()
        database = urlsplit(dsn).path.lstrip("/")
        admin = await asyncpg.connect(ADMIN_DSN)
        try:
            await admin.execute(
                f"CREATE ROLE {self.owner} LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE;"
                f"CREATE ROLE {self.worker} LOGIN IN ROLE {names.worker};"
                f"CREATE ROLE {self.producer} LOGIN IN ROLE {names.producer};"
                f"CREATE ROLE {self.operator} LOGIN IN ROLE {names.operator};"
                f'ALTER DATABASE "{database}" OWNER TO {self.owner}'
            )
        finally:
            await admin.close()
        conn = await asyncpg.connect(dsn)
        try:
            await conn.execute("DROP SCHEMA IF EXISTS pacerd CASCADE")
        finally:
            await conn.close()
        await ledger.migrate(with_user(dsn, self.owner))
        vhost = _vhost(amqp_url)
        queue = ready_queue_name(destination)
        commands = [
            command
            for user, permissions in (
                (self.daemon_user, DAEMON_BROKER_PERMISSIONS),
                (self.worker_user, worker_broker_permissions([queue])),
            )
            for command in (
                ("add_user", user, self.password),
                tuple(permissions.rabbitmqctl(vhost, user)),
            )
        ]
        await anyio.to_thread.run_sync(functools.partial(broker_user_commands, *commands))

    async def drop(self, dsn: str) -> None:
        """Deletes the broker users and the roles (the database's objects go back
        to the administrator first); each step is tried whatever the last did."""
        deletions = [("delete_user", user) for user in (self.daemon_user, self.worker_user)]
        delete = functools.partial(broker_user_commands, *deletions, check=False)
        await anyio.to_thread.run_sync(delete)
        roles = list(self.roles)
        with contextlib.suppress(*DB_DOWN):
            admin = await asyncpg.connect(ADMIN_DSN)
            try:
                await admin.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                    " WHERE usename = ANY($1::text[])",
                    roles,
                )
            finally:
                await admin.close()
        for url in (dsn, ADMIN_DSN):  # the ledger's database, then the cluster's
            with contextlib.suppress(*DB_DOWN):
                conn = await asyncpg.connect(url)
                try:
                    await conn.execute(
                        f"REASSIGN OWNED BY {', '.join(roles)} TO CURRENT_USER;"
                        f"DROP OWNED BY {', '.join(roles)}"
                    )
                finally:
                    await conn.close()
        admin = await asyncpg.connect(ADMIN_DSN)
        try:
            for role in roles:
                await admin.execute(f"DROP ROLE IF EXISTS {role}")
        finally:
            await admin.close()

    async def sessions(self, db: asyncpg.Pool) -> list[str]:
        """The users of the sessions on the ledger's database that are not the harness's."""
        rows = await db.fetch(
            "SELECT usename FROM pg_stat_activity WHERE datname = current_database()"
            " AND pid <> pg_backend_pid() AND coalesce(application_name, '') <> $1"
            " AND backend_type = 'client backend'",
            HARNESS_APP,
        )
        return [str(r["usename"]) for r in rows]


async def broker_users(amqp_url: str) -> list[str]:
    """The user of each connection to the vhost of ``amqp_url``."""
    vhost = _vhost(amqp_url)
    done = await anyio.to_thread.run_sync(
        lambda: rabbitmqctl("list_connections", "--no-table-headers", "vhost", "user")
    )
    if done.returncode != 0:
        raise RuntimeError(f"rabbitmqctl list_connections: {done.stderr.strip()}")
    rows = [line.split("\t") for line in done.stdout.splitlines()]
    return [row[1] for row in rows if len(row) == 2 and row[0] == vhost]


def _vhost(amqp_url: str) -> str:
    return unquote(urlsplit(amqp_url).path.lstrip("/")) or "/"


# -- the rig ---------------------------------------------------------------------------


class Rig:
    """One scenario's world: ledger, vhost, upstream, proxies, daemons, workers."""

    def __init__(
        self,
        *,
        dsn: str,
        amqp_url: str,
        workdir: Path,
        destination: str,
        knobs: Knobs | None = None,
        capacity: float = 600.0,
        burst_seconds: float = 0.5,
        proxy_ledger: bool = False,
        proxy_broker: bool = False,
        proxy_workers: bool = False,
        hold_ms: float = 0.0,
        prefetch: int = 16,
        upstream_latency_ms: float = 5.0,
        log_level: str = "debug",
        restart_seconds: float = 2.0,
        roles: bool = True,
        partitions: int = 1,
    ) -> None:
        self.dsn, self.amqp_url, self.workdir = dsn, amqp_url, workdir
        # Each party on its own role and broker user (False: all on the administrator's).
        self.identities = Identities.fresh() if roles else None
        self.ledger_users: Counter[str] = Counter()  # non-harness sessions, per user, per sample
        self.restart_seconds = restart_seconds
        self.destination = destination
        # The ledger's partitions (set before any pacerd starts): with one, a
        # second pacerd is a standby for the rig's destination, not the leader
        # of a share of the partitions that may hold it.
        self.partitions = partitions
        self.partition: int | None = None  # the destination's, once the ledger is set up
        self.knobs = knobs or Knobs()
        self.capacity, self.burst_seconds = capacity, burst_seconds
        self.hold_ms, self.prefetch, self.log_level = hold_ms, prefetch, log_level
        self.upstream = ModelUpstream(
            UpstreamParams(
                schedule=CapacitySchedule(((0.0, capacity),)),
                burst_seconds=burst_seconds,
                latency_median_ms=upstream_latency_ms,
                latency_sigma=0.3,
            ),
            seed=7,
        )
        parts = urlsplit(dsn)
        amqp = urlsplit(amqp_url)
        self.ledger_proxy = FaultProxy(parts.port or 5432) if proxy_ledger else None
        self.broker_proxy = FaultProxy(amqp.port or 5672) if proxy_broker else None
        self.worker_proxy = FaultProxy(amqp.port or 5672) if proxy_workers else None
        self.pool: asyncpg.Pool | None = None
        self.producer_pool: asyncpg.Pool | None = None
        self.operator_pool: asyncpg.Pool | None = None
        self.pacerds: list[PacerdProc] = []
        self.workers: list[WorkerProc] = []
        self.faults: list[Fault] = []
        self.crashes: list[str] = []
        self.restarted: set[Daemon] = set()  # crashes restarted, as systemd would
        self.crashes_allowed = 0
        self.crash_loop_after = 5
        self._tg: TaskGroup | None = None
        self.jobs = 0
        self.started_at = time.time()
        self.extra_deliveries_allowed = 0
        self._n = 0
        (workdir / "logs").mkdir(parents=True, exist_ok=True)

    # -- lifecycle

    async def __aenter__(self) -> Rig:
        try:
            if self.identities is not None:
                await self.identities.create(self.dsn, self.amqp_url, self.destination)
            await self._set_partitions()
        except BaseException:
            if self.identities is not None:
                with anyio.CancelScope(shield=True):
                    await self.identities.drop(self.dsn)
            raise
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        self._tg.start_soon(self._supervise)
        settings = {"application_name": HARNESS_APP}
        self.pool = await asyncpg.create_pool(
            self.dsn, min_size=1, max_size=4, server_settings=settings
        )
        if self.identities is not None:
            # The workload and the operator's calls are the harness's too (they ride
            # out terminated backends), each on its own role.
            self.producer_pool = await asyncpg.create_pool(
                with_user(self.dsn, self.identities.producer), min_size=1, max_size=2,
                server_settings=settings,
            )  # fmt: skip
            self.operator_pool = await asyncpg.create_pool(
                with_user(self.dsn, self.identities.operator), min_size=1, max_size=2,
                server_settings=settings,
            )  # fmt: skip
            self._tg.start_soon(self._watch_sessions)
        await self.upstream.start()
        for proxy in (self.ledger_proxy, self.broker_proxy, self.worker_proxy):
            if proxy is not None:
                await proxy.start()
        await self._declare_queue()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if self._tg is not None:
            self._tg.cancel_scope.cancel()
            await self._tg.__aexit__(None, None, None)
        with anyio.CancelScope(shield=True):
            try:
                await self.stop_all()
                for proxy in (self.ledger_proxy, self.broker_proxy, self.worker_proxy):
                    if proxy is not None:
                        await proxy.close()
                await self.upstream.close()
                with contextlib.suppress(Exception):
                    await self._delete_queue()
            finally:
                for pool in (self.producer_pool, self.operator_pool, self.pool):
                    if pool is not None:
                        with contextlib.suppress(Exception):
                            await pool.close()
                if self.identities is not None:
                    await self.identities.drop(self.dsn)

    async def _set_partitions(self) -> None:
        led = await ledger.Ledger.connect(self.dsn, max_size=1)
        try:
            await led.set_partitions(self.partitions)
            assert await led.read_partitions() == self.partitions
            self.partition = await led.pool.fetchval(
                "SELECT pacerd._partition_of($1, $2)", self.destination, self.partitions
            )
        finally:
            await led.close()

    async def _supervise(self) -> None:
        """Restarts a pacerd or worker that exits on its own after
        ``restart_seconds``, as the systemd unit does (``Restart=on-failure``,
        ``RestartSec=2``); each crash is recorded (the audit counts them)."""
        while True:
            for p in [*self.pacerds, *self.workers]:
                if p.alive or p.killed or p.stopped or p in self.restarted:
                    continue
                self.restarted.add(p)
                error = next(
                    (line for line in reversed(p.text().splitlines()) if "Error" in line), ""
                )
                self.crashes.append(f"{p.name} exited ({p.process.returncode}): {error.strip()}")
                await anyio.sleep(self.restart_seconds)
                if isinstance(p, PacerdProc):
                    await self.start_pacerd(wait_ready=False, proxied=p.proxied)
                else:
                    await self.start_worker()
            await anyio.sleep(0.1)

    async def _watch_sessions(self) -> None:
        """Records, every half second, who the sessions on the ledger that are
        not the harness's run as (the audit checks each party kept to its role)."""
        assert self.identities is not None
        while True:
            with contextlib.suppress(*DB_DOWN):
                self.ledger_users.update(await self.identities.sessions(self.db()))
            await anyio.sleep(0.5)

    async def stop_all(self) -> None:
        """SIGTERM every child (daemons first), SIGKILL what is left after a few seconds."""
        for group in (self.pacerds, self.workers):
            async with anyio.create_task_group() as tg:
                for p in group:
                    tg.start_soon(functools.partial(p.stop, grace=8))

    async def _declare_queue(self) -> None:
        """Declares the destination's ready queue, and empties the vhost's outcome
        queues: what an earlier scenario left there (a poison message) is not ours."""
        connection = await aio_pika.connect(self.amqp_url)
        async with connection:
            channel = await connection.channel()
            await channel.declare_queue(
                ready_queue_name(self.destination),
                durable=True,
                arguments={"x-queue-type": "quorum"},
            )
            for name in (OUTCOMES_QUEUE, INVALID_QUEUE):
                queue = await channel.declare_queue(
                    name, durable=True, arguments={"x-queue-type": "quorum"}
                )
                await queue.purge()

    async def _delete_queue(self) -> None:
        connection = await aio_pika.connect(self.amqp_url)
        async with connection:
            channel = await connection.channel()
            await channel.queue_delete(ready_queue_name(self.destination))

    # -- addresses

    @property
    def daemon_dsn(self) -> str:
        """The ledger as the daemon reaches it directly (as the owner role)."""
        ids = self.identities
        return self.dsn if ids is None else with_user(self.dsn, ids.owner)

    @property
    def daemon_amqp_url(self) -> str:
        ids = self.identities
        if ids is None:
            return self.amqp_url
        return with_user(self.amqp_url, ids.daemon_user, ids.password)

    @property
    def pacerd_dsn(self) -> str:
        dsn = self.daemon_dsn
        return with_port(dsn, self.ledger_proxy.port) if self.ledger_proxy else dsn

    @property
    def pacerd_amqp_url(self) -> str:
        if self.broker_proxy is None:
            return self.daemon_amqp_url
        return with_port(self.daemon_amqp_url, self.broker_proxy.port)

    @property
    def worker_dsn(self) -> str:
        ids = self.identities
        return self.dsn if ids is None else with_user(self.dsn, ids.worker)

    @property
    def worker_amqp_url(self) -> str:
        ids = self.identities
        url = self.amqp_url
        if ids is not None:
            url = with_user(url, ids.worker_user, ids.password)
        if self.worker_proxy is None:
            return url
        return with_port(url, self.worker_proxy.port)

    def db(self) -> asyncpg.Pool:
        """The harness's own pool (the administrator): the audit, the faults."""
        assert self.pool is not None
        return self.pool

    def producer(self) -> asyncpg.Pool:
        """The workload's pool: a member of the producer role."""
        return self.producer_pool or self.db()

    def operator(self) -> asyncpg.Pool:
        """The operator's pool (pause, resume, replay): a member of the operator role."""
        return self.operator_pool or self.db()

    # -- children

    def _next(self, prefix: str) -> str:
        self._n += 1
        return f"{prefix}-{self._n}"

    def write_config(
        self, name: str, *, knobs: Knobs | None = None, http_port: int = 0, proxied: bool = True
    ) -> Path:
        path = self.workdir / f"{name}.toml"
        path.write_text(
            config_toml(
                knobs or self.knobs,
                dsn=self.pacerd_dsn if proxied else self.daemon_dsn,
                amqp_url=self.pacerd_amqp_url if proxied else self.daemon_amqp_url,
                http_port=http_port,
                log_level=self.log_level,
            )
        )
        return path

    async def start_pacerd(
        self, *, wait_ready: bool = True, knobs: Knobs | None = None, proxied: bool = True
    ) -> PacerdProc:
        """A ``pacerd run`` (through the proxies, unless ``proxied`` is False)."""
        name = self._next("pacerd")
        port = free_port()
        config = self.write_config(name, knobs=knobs, http_port=port, proxied=proxied)
        env = {"PACERD_DAEMON__INSTANCE_NAME": f"{self.destination}/{name}"}
        proc = PacerdProc(name, config, env, self.workdir / "logs" / f"{name}.log", port, proxied)
        self.pacerds.append(proc)
        if wait_ready:
            await proc.wait_event("pacerd_ready", within=60)
        return proc

    def instance_of(self, proc: PacerdProc) -> str:
        return f"{self.destination}/{proc.name}"

    async def start_worker(self) -> WorkerProc:
        name = self._next("worker")
        config = self.workdir / "worker.toml"
        if not config.exists():
            config.write_text(
                config_toml(self.knobs, dsn=self.worker_dsn, amqp_url=self.worker_amqp_url,
                            http_port=None, log_level="info")
            )  # fmt: skip
        calls = self.workdir / "logs" / f"{name}.calls.jsonl"
        env = {
            "FAULT_UPSTREAM": self.upstream.url,
            "FAULT_DESTINATIONS": self.destination,
            "FAULT_CALL_LOG": str(calls),
            "FAULT_HOLD_MS": str(self.hold_ms),
            "FAULT_PREFETCH": str(self.prefetch),
        }
        proc = WorkerProc(name, config, env, self.workdir / "logs" / f"{name}.log", calls)
        self.workers.append(proc)
        return proc

    async def start_workers(self, n: int) -> list[WorkerProc]:
        procs = [await self.start_worker() for _ in range(n)]
        for p in procs:
            await p.wait_event("worker_started", within=60)
        return procs

    async def start(self, *, workers: int) -> tuple[PacerdProc, list[WorkerProc]]:
        """Workers and one pacerd, started together (their start-ups overlap)."""
        procs = [await self.start_worker() for _ in range(workers)]
        pacerd = await self.start_pacerd(wait_ready=False)
        for p in procs:
            await p.wait_event("worker_started", within=60)
        await pacerd.wait_event("pacerd_ready", within=60)
        return pacerd, procs

    def live_pacerds(self) -> list[PacerdProc]:
        return [p for p in self.pacerds if p.alive]

    # -- workload

    async def schedule(
        self,
        n: int,
        *,
        prefix: str = "job",
        overdue_from_seconds: float = 3600.0,
        overdue_to_seconds: float = 600.0,
        payload_bytes: int = 64,
    ) -> int:
        """``n`` jobs that fell due between ``overdue_from`` and ``overdue_to`` seconds
        ago, oldest first, through ``pacerd.schedule`` in batches."""
        done = 0
        batch = 5000
        pad = "x" * max(0, payload_bytes - 20)
        async with self.producer().acquire() as conn:
            for start in range(1, n + 1, batch):
                stop = min(n, start + batch - 1)
                done += await conn.fetchval(
                    "SELECT count(*) FILTER (WHERE pacerd.schedule(job_id => $1 || g,"
                    " kind => 'fault.call', destination => $2,"
                    " payload => jsonb_build_object('n', g, 'pad', $6::text),"
                    " eligible_at => now() - make_interval(secs => $4::float8"
                    " - ($4::float8 - $5::float8) * g::float8 / $3::float8))"
                    " = 'scheduled') FROM generate_series($7::int, $8::int) g",
                    f"{prefix}-",
                    self.destination,
                    float(n),
                    overdue_from_seconds,
                    overdue_to_seconds,
                    pad,
                    start,
                    stop,
                )
        self.jobs += done
        return done

    async def counts(self) -> dict[str, int]:
        rows = await self.db().fetch(
            "SELECT state, count(*) AS n FROM pacerd.jobs WHERE destination = $1 GROUP BY state",
            self.destination,
        )
        return {r["state"]: r["n"] for r in rows}

    async def wait_counts(
        self, predicate: Callable[[dict[str, int]], bool], *, within: float
    ) -> dict[str, int]:
        """Polls the state counts (riding out a ledger that is down) until ``predicate``."""
        with anyio.fail_after(within):
            while True:
                try:
                    counts = await self.counts()
                except DB_DOWN:
                    counts = None
                if counts is not None and (predicate(counts) or self.crash_looping()):
                    return counts
                await anyio.sleep(0.1)

    async def counts_completed(self) -> int:
        n = await self.db().fetchval(
            "SELECT count(*) FROM pacerd.jobs WHERE destination = $1 AND state = 'completed'",
            self.destination,
        )
        return int(n)

    async def wait_completed(self, n: int, *, within: float) -> dict[str, int]:
        return await self.wait_counts(lambda c: c.get("completed", 0) >= n, within=within)

    # -- faults

    @contextlib.asynccontextmanager
    async def fault(self, kind: str, **detail: Any) -> AsyncIterator[Fault]:
        record = Fault(kind=kind, started=time.time(), detail=dict(detail))
        self.faults.append(record)
        try:
            yield record
        finally:
            record.ended = time.time()

    async def stranded_claims(self, instance: str) -> list[tuple[str, int]]:
        rows = await self.db().fetch(
            "SELECT job_id, attempt FROM pacerd.jobs WHERE state = 'claimed' AND claimed_by = $1",
            instance,
        )
        return [(r["job_id"], r["attempt"]) for r in rows]

    async def claimed_since(self, instance: str, since: dt.datetime) -> list[tuple[str, int]]:
        """Claims of ``instance`` still held (not offered) whose claim came after ``since``."""
        rows = await self.db().fetch(
            "SELECT j.job_id, j.attempt FROM pacerd.jobs j JOIN pacerd.job_events c"
            " ON c.job_id = j.job_id AND c.attempt = j.attempt AND c.event = 'claimed'"
            " WHERE j.state = 'claimed' AND j.claimed_by = $1 AND c.at > $2",
            instance,
            since,
        )
        return [(r["job_id"], r["attempt"]) for r in rows]

    def delivered(self) -> set[tuple[str, int]]:
        """The offers (job_id, attempt) that reached a worker: called, or skipped as stale."""
        calls = self.call_log()
        out = {(str(c["job_id"]), int(c["attempt"])) for c in calls if c.get("ev") == "start"}
        return out | set(self.skipped_offers())

    async def claim_windows(self, instance: str) -> tuple[int, int]:
        """For the claims of the last tick of ``instance`` (a killed daemon) that were
        never marked offered: how many reached a worker (published, the daemon died
        before mark-offered) and how many did not (claimed, never published). From
        the ledger's history and the workers' logs, after the fact."""
        rows = await self.db().fetch(
            "WITH last AS (SELECT max(at) AS at FROM pacerd.job_events WHERE event = 'claimed'"
            " AND detail->>'by' = $1)"
            " SELECT c.job_id, c.attempt FROM pacerd.job_events c, last WHERE c.event = 'claimed'"
            " AND c.detail->>'by' = $1 AND c.at = last.at AND NOT EXISTS (SELECT 1"
            " FROM pacerd.job_events o WHERE o.job_id = c.job_id AND o.attempt = c.attempt"
            " AND o.event = 'offered')",
            instance,
        )
        delivered = self.delivered()
        published = sum(1 for r in rows if (r["job_id"], r["attempt"]) in delivered)
        return published, len(rows) - published

    async def terminate_backends(self) -> int:
        """``pg_terminate_backend`` of every session on this ledger but the harness's."""
        rows = await self.db().fetch(
            "SELECT pg_terminate_backend(pid) AS ok FROM pg_stat_activity"
            " WHERE datname = current_database() AND pid <> pg_backend_pid()"
            " AND coalesce(application_name, '') <> $1",
            HARNESS_APP,
        )
        return sum(1 for r in rows if r["ok"])

    def publish_trigger(self, action: Callable[[], Awaitable[None]]) -> None:
        """Arms the broker proxy: ``action`` runs before the next publish of ready
        work is forwarded (once)."""
        assert self.broker_proxy is not None
        proxy = self.broker_proxy

        async def hook(chunk: bytes) -> None:
            if PUBLISH_FRAME in chunk:
                proxy.on_client_chunk = None
                await action()

        proxy.on_client_chunk = hook

    # -- reading the logs

    def call_log(self) -> list[dict[str, Any]]:
        calls = []
        for w in self.workers:
            if w.calls.exists():
                for line in w.calls.read_text().splitlines():
                    with contextlib.suppress(ValueError):
                        calls.append(json.loads(line))
        return calls

    def skipped_offers(self) -> list[tuple[str, int]]:
        return [
            (str(e.get("job_id")), int(e.get("attempt") or 0))
            for w in self.workers
            for e in w.events("offer_not_current")
        ]

    def tick_logs(self) -> list[dict[str, Any]]:
        ticks = []
        for p in self.pacerds:
            for e in p.events(TICK_EVENT):
                if e.get("destination") == self.destination:
                    e["instance"] = self.instance_of(p)
                    ticks.append(e)
        return ticks

    # -- the audit

    async def settle(self, *, within: float) -> bool:
        """Waits until nothing is in flight and nothing is due or about to be (a
        retry's backoff); jobs scheduled for later (the workload's own) may wait.
        False when the ledger stood still for ``within`` seconds before that: a
        stuck drain fails, a drain that is only slow (a loaded machine) is
        waited for as long as its jobs keep moving."""
        soon = self.knobs.backoff_cap_seconds + 2.0
        seen: object = None
        while True:
            with anyio.move_on_after(within) as still:
                while True:
                    try:
                        row = await self.db().fetchrow(
                            "SELECT count(*) FILTER (WHERE state IN ('claimed', 'offered'))"
                            " AS busy, count(*) FILTER (WHERE state = 'scheduled' AND"
                            " next_attempt_at <= now() + make_interval(secs => $2)) AS due,"
                            " count(*) FILTER (WHERE state IN ('completed', 'dead')) AS done,"
                            " coalesce(sum(attempt), 0) AS attempts"
                            " FROM pacerd.jobs WHERE destination = $1",
                            self.destination,
                            soon,
                        )
                    except DB_DOWN:
                        row = None
                    if row is not None and row["busy"] == 0 and row["due"] == 0:
                        return True
                    if self.crash_looping():
                        return False
                    now = None if row is None else (row["done"], row["attempts"], row["busy"])
                    if now is not None and now != seen:
                        seen = now
                        break  # moving: wait another ``within`` from here
                    await anyio.sleep(0.2)
            if still.cancelled_caught:
                return False

    def crash_looping(self) -> bool:
        """More crashes than the scenario allows, by ``crash_loop_after``: waiting
        longer is pointless."""
        return len(self.crashes) > self.crashes_allowed + self.crash_loop_after

    async def audit(
        self,
        scenario: str,
        *,
        within: float,
        bounds: Bounds | None = None,
        superseded_keys: Sequence[str] = (),
        expect_healthy: Sequence[PacerdProc] | None = None,
    ) -> Audit:
        bounds = bounds or Bounds()
        settled = await self.settle(within=within)
        db = self.db()
        notes = []
        if not settled:
            notes.append(
                "stopped waiting: more crashes than the scenario allows"
                if self.crash_looping()
                else f"did not settle: the ledger stood still for {within:.0f} s"
            )
        if (cadence := self.tick_cadence()) is not None:
            notes.append(
                f"busy ticks every {cadence:.2f} s (median; tick_seconds {self.knobs.tick_seconds})"
            )
        states = await self.counts()
        present = sum(states.values())
        row = await db.fetchrow(
            "SELECT count(*) FILTER (WHERE state IN ('claimed', 'offered')) AS stuck,"
            " count(*) FILTER (WHERE state = 'scheduled' AND next_attempt_at <= now()) AS due,"
            " count(*) FILTER (WHERE state = 'scheduled' AND next_attempt_at > now()) AS future,"
            " count(*) FILTER (WHERE state = 'dead') AS dead,"
            " count(*) FILTER (WHERE state = 'dead' AND coalesce(last_error, '') = '' AND"
            "   NOT EXISTS (SELECT 1 FROM pacerd.job_events e WHERE e.job_id = j.job_id"
            "   AND e.event = 'dead' AND e.detail ? 'reason')) AS dead_bare"
            " FROM pacerd.jobs j WHERE destination = $1",
            self.destination,
        )
        assert row is not None
        # Side effects: the upstream's record of accepted keys, against the ledger.
        keys = self.upstream.model.keys
        completed = await db.fetch(
            "SELECT job_id, revision FROM pacerd.jobs WHERE destination = $1"
            " AND state = 'completed'",
            self.destination,
        )
        without_effect = sum(1 for r in completed if f"{r['job_id']}@r{r['revision']}" not in keys)
        completions = await db.fetch(
            "SELECT e.detail->'detail'->>'key' AS key, min(e.at) AS at FROM pacerd.job_events e"
            " JOIN pacerd.jobs j USING (job_id) WHERE j.destination = $1"
            " AND e.event = 'completed' GROUP BY 1",
            self.destination,
        )
        completed_at = {r["key"]: _epoch(r["at"]) for r in completions if r["key"]}
        calls = self.call_log()
        accepted = [c for c in calls if c.get("ev") == "called" and c.get("status") == 200]
        starts = {
            (c["key"], c["job_id"], c["attempt"], c["pid"]): c["t"]
            for c in calls
            if c.get("ev") == "start"
        }
        dup_effects = 0
        for c in accepted:
            done = completed_at.get(c["key"])
            began = starts.get((c["key"], c["job_id"], c["attempt"], c["pid"]), c["t"])
            if done is not None and began > done + 0.001:
                dup_effects += 1
        superseded = sum(keys.get(k, 0) for k in superseded_keys)
        # Offers: every delivery the workers saw (handler runs and skipped stale
        # offers) beyond the one each applied outcome asks for.
        deliveries: Counter[str] = Counter(c["job_id"] for c in calls if c.get("ev") == "start")
        for job_id, _attempt in self.skipped_offers():
            deliveries[job_id] += 1
        returns = await db.fetch(
            "SELECT e.job_id, count(*) AS n FROM pacerd.job_events e JOIN pacerd.jobs j"
            " USING (job_id) WHERE j.destination = $1"
            " AND e.event IN ('refused', 'rescheduled', 'continued', 'revised') GROUP BY 1",
            self.destination,
        )
        expected = {r["job_id"]: 1 + r["n"] for r in returns}
        dup_offers = sum(max(0, n - expected.get(j, 1)) for j, n in deliveries.items())
        over, ticks_logged, groups, worst = await self._budget_audit()
        if worst is not None:
            notes.append(f"over budget: {worst}")
        seconds = self.upstream.model.seconds(self.upstream.clock.monotonic())
        peak = max((s.accepted + s.refused + s.errors for s in seconds), default=0)
        refused = sum(s.refused for s in seconds)
        recovery = await self._recovery()
        unhealthy = []
        for p in self.live_pacerds() if expect_healthy is None else expect_healthy:
            status = 0
            with anyio.move_on_after(10):  # a daemon restarted a moment ago gets to start
                while p.alive and (status := await p.healthz()) != 200:
                    await anyio.sleep(0.2)
            if not p.alive or status != 200:
                unhealthy.append(f"{p.name} /healthz {status} (alive: {p.alive})")
        identities = await self._identity_audit(notes)
        return Audit(
            scenario=scenario,
            jobs=self.jobs,
            faults=list(self.faults),
            states=states,
            missing=max(0, self.jobs - present),
            stuck=row["stuck"],
            due_left=row["due"],
            future=row["future"],
            dead=row["dead"],
            dead_without_reason=row["dead_bare"],
            completed_without_effect=without_effect,
            replays=self.upstream.model.duplicates,
            dup_effects=dup_effects,
            superseded_executed=superseded,
            dup_offers=dup_offers,
            deliveries=sum(deliveries.values()),
            max_over_budget=over,
            ticks_logged=ticks_logged,
            claim_groups=groups,
            upstream_capacity=self.capacity,
            upstream_peak=peak,
            upstream_refused=refused,
            recovery_seconds=recovery,
            unhealthy=unhealthy,
            crashes=list(self.crashes),
            bounds=bounds,
            notes=notes,
            elapsed_seconds=time.time() - self.started_at,
            identities=identities,
        )

    async def _identity_audit(self, notes: list[str]) -> dict[str, list[str]]:
        """Checks that every session on the ledger but the harness's ran as the
        daemon's owner role or the workers' role, and every connection to the
        vhost as the harness's, the daemon's or the workers' broker user; and
        that the daemons and workers were seen on theirs (a party on another
        identity is a violation, noted)."""
        ids = self.identities
        if ids is None:
            return {}
        with contextlib.suppress(*DB_DOWN):
            self.ledger_users.update(await ids.sessions(self.db()))
        seen = set(self.ledger_users)
        if foreign := sorted(seen - {ids.owner, ids.worker}):
            notes.append(f"VIOLATION: ledger sessions as {foreign}, not a daemon's or worker's")
        if self.pacerds and ids.owner not in seen:
            notes.append(f"VIOLATION: no ledger session of a daemon as {ids.owner}")
        if self.workers and ids.worker not in seen:
            notes.append(f"VIOLATION: no ledger session of a worker as {ids.worker}")
        users = set(await broker_users(self.amqp_url))
        harness = urlsplit(self.amqp_url).username or "guest"
        if foreign := sorted(users - {harness, ids.daemon_user, ids.worker_user}):
            notes.append(f"VIOLATION: broker connections as {foreign}")
        if self.live_pacerds() and ids.daemon_user not in users:
            notes.append(f"VIOLATION: no broker connection of a live daemon as {ids.daemon_user}")
        if any(w.alive for w in self.workers) and ids.worker_user not in users:
            notes.append(f"VIOLATION: no broker connection of a live worker as {ids.worker_user}")
        return {"ledger": sorted(seen), "broker": sorted(users - {harness})}

    def tick_cadence(self) -> float | None:
        """The median time between two consecutive ticks of one pacerd that both
        claimed work (the loop's real period under load)."""
        by_instance: dict[str, list[float]] = defaultdict(list)
        for t in self.tick_logs():
            if int(t.get("claimed") or 0) > 0 and "timestamp" in t:
                stamp = dt.datetime.fromisoformat(t["timestamp"]).timestamp()
                by_instance[t["instance"]].append(stamp)
        gaps = sorted(
            b - a for stamps in by_instance.values() for a, b in itertools.pairwise(stamps)
        )
        return gaps[len(gaps) // 2] if gaps else None

    async def _budget_audit(self) -> tuple[int, int, int, str | None]:
        """Per tick (debug ``tick_completed`` logs): claimed - budget. Per one-second
        window of the ledger's claims (every instance together): claims - (the
        highest rate logged around it x (1 s + two ticks) + 1: a tick's budget
        covers at most two ticks of elapsed time, plus less than one of credit;
        twice that rate, at most ``max_rate``, where a tick never logged its rate
        (killed mid-tick: in slow start the rate may have doubled); plus a tick's
        budget for each tick that failed after claiming, which the next tick does
        not know about). Returns the worst excess, the ticks logged, the claim groups, and what the
        worst window held when it went over."""
        ticks = self.tick_logs()
        over = max((int(t["claimed"]) - int(t["budget"]) for t in ticks), default=0)
        worst: str | None = None
        if over > 0:
            bad = max(ticks, key=lambda t: int(t["claimed"]) - int(t["budget"]))
            worst = f"a tick claimed {bad['claimed']} of a budget of {bad['budget']}: {bad}"
        rows = await self.db().fetch(
            "SELECT e.at, e.detail->>'by' AS by, count(*) AS n FROM pacerd.job_events e"
            " JOIN pacerd.jobs j USING (job_id) WHERE j.destination = $1 AND e.event = 'claimed'"
            " GROUP BY 1, 2 ORDER BY 1",
            self.destination,
        )
        groups = [(_epoch(r["at"]), int(r["n"]), str(r["by"])) for r in rows]
        rates = sorted(
            (dt.datetime.fromisoformat(t["timestamp"]).timestamp(), float(t["rate"]))
            for t in ticks
            if "timestamp" in t
        )
        logged = {
            (
                t["instance"],
                int(t["claimed"]),
                dt.datetime.fromisoformat(t["timestamp"]).timestamp(),
            )
            for t in ticks
            if "timestamp" in t and int(t["claimed"]) > 0
        }

        def unlogged(at: float, n: int, by: str) -> bool:
            """A claim whose tick never logged (killed or failed mid-tick)."""
            return not any(i == by and c == n and at <= t <= at + 5 for i, c, t in logged)

        failed = sorted(
            dt.datetime.fromisoformat(e["timestamp"]).timestamp()
            for p in self.pacerds
            for e in p.events("tick_failed")
            if e.get("destination") == self.destination and "timestamp" in e
        )
        k = self.knobs
        window = 1.0
        j = 0
        for i, (t0, _n, _by) in enumerate(groups):
            while groups[j][0] < t0 - window + 1e-9:
                j += 1
            held = groups[j : i + 1]
            claims = sum(n for _t, n, _b in held)
            near = [r for t, r in rates if t0 - window - 1.0 <= t <= t0 + 1.0]
            rate = max(near, default=k.max_rate)
            if any(unlogged(*g) for g in held):
                # Its rate was never logged: it may have grown since (slow start doubles it).
                rate = min(k.max_rate, 2.0 * rate)
            allowance = math.ceil(rate * (window + 2 * k.tick_seconds)) + 1
            # A tick that failed after its claim (the ledger went away before its state
            # was saved) is not charged: the next tick starts from the last saved state.
            uncharged = sum(1 for t in failed if t0 - window - 1.0 <= t <= t0)
            allowance += uncharged * (math.ceil(rate * 2 * k.tick_seconds) + 1)
            if claims - allowance > over:
                over = claims - allowance
                shown = [(round(t - t0, 3), n, b) for t, n, b in held]
                worst = (
                    f"{claims} claims in the second before {t0:.3f} (allowance {allowance} at"
                    f" rate {rate:.1f}): {shown}"
                )
        return max(0, over), len(ticks), len(groups), worst

    async def _recovery(self) -> float | None:
        """The longest time, over the faults, from a fault's end to the completion
        of a job claimed after it (progress again)."""
        worst: float | None = None
        for f in self.faults:
            if f.ended is None:
                continue
            at = await self.db().fetchval(
                "SELECT min(c.at) FROM pacerd.job_events c JOIN pacerd.jobs j USING (job_id)"
                " WHERE j.destination = $1 AND c.event = 'completed' AND EXISTS ("
                "   SELECT 1 FROM pacerd.job_events e WHERE e.job_id = c.job_id"
                "   AND e.event = 'claimed' AND e.attempt = c.attempt AND e.at >= $2)",
                self.destination,
                dt.datetime.fromtimestamp(f.ended, dt.UTC),
            )
            if at is None:
                continue
            seconds = max(0.0, _epoch(at) - f.ended)
            f.detail["recovery_seconds"] = round(seconds, 2)
            worst = seconds if worst is None else max(worst, seconds)
        return worst


# -- samplers ----------------------------------------------------------------------------


@dataclass(slots=True)
class Sample:
    t: float
    oldest_due_age: float | None
    due: int
    inflight: int
    tick: str = ""  # the tick that triggered it: instance, budget, claimed
    claimed: int = -1  # what that tick claimed (-1: not sampled on a tick)
    budget: int = -1  # that tick's budget (-1: not sampled on a tick)


async def sample_once(
    rig: Rig, out: list[Sample], tick: str = "", claimed: int = -1, budget: int = -1
) -> None:
    """One sample of the oldest-due age, due and in flight, now."""
    row = await rig.db().fetchrow(
        "SELECT extract(epoch FROM now() - min(next_attempt_at) FILTER (WHERE"
        " state = 'scheduled' AND next_attempt_at <= now()))::float8 AS age,"
        " count(*) FILTER (WHERE state = 'scheduled' AND next_attempt_at <= now()) AS due,"
        " count(*) FILTER (WHERE state IN ('claimed', 'offered')) AS inflight"
        " FROM pacerd.jobs WHERE destination = $1",
        rig.destination,
    )
    assert row is not None
    out.append(Sample(time.time(), row["age"], row["due"], row["inflight"], tick, claimed, budget))


async def sample_forever(rig: Rig, out: list[Sample], every: float) -> None:
    """Oldest-due age (as ``pacerd status`` reports it: the oldest due job still
    scheduled), due and in flight, every ``every`` seconds of wall time."""
    while True:
        await sample_once(rig, out)
        await anyio.sleep(every)


async def sample_every_tick(rig: Rig, out: list[Sample]) -> None:
    """The same, once after every admission tick of whichever pacerd leads the
    destination (each tick record that was not skipped)."""
    offsets: dict[str, int] = {}
    while True:
        ticked, claimed, budget = "", -1, -1
        for p in rig.pacerds:
            with contextlib.suppress(OSError):
                with p.log.open("rb") as f:
                    f.seek(offsets.get(p.name, 0))
                    data = f.read()
                end = data.rfind(b"\n") + 1
                offsets[p.name] = offsets.get(p.name, 0) + end
                for doc in records(data[:end].decode(errors="replace"), TICK_EVENT):
                    if doc["destination"] == rig.destination and doc.get("skipped") is None:
                        ticked = f"{p.name} budget {doc['budget']} claimed {doc['claimed']}"
                        claimed, budget = int(doc["claimed"]), int(doc["budget"])
        if ticked:
            await sample_once(rig, out, ticked, claimed, budget)
        await anyio.sleep(0.01)


def rises(samples: Sequence[Sample], *, tolerance: float = 0.0) -> list[tuple[float, float]]:
    """(time, rise) wherever the oldest-due age went up between two samples.

    With samples taken after each tick: when a tick ends late the next one starts
    at once, so the sample after a tick can already see the next tick's claims;
    the sample after that next tick then sees no new claim. Such a pair (the due
    count unchanged, the later tick having claimed, the rise no more than the
    time between the samples) is the sampling race, not a rise of the age. So
    is a tick with no budget right after one that claimed: a tick that ends
    late is followed at once by the next, which pays for at most CATCH_UP x
    the rate over its span (``pacer.tick_budget``), sometimes less than a job;
    the age then grows by the time between the two samples, and the next tick
    claims. Every tick spans at least half a tick, so at the drill's rates (a
    job a tick or more) two ticks in a row with no budget do not happen
    (``test_at_a_job_a_tick_or_more_no_two_ticks_in_a_row_send_nothing``):
    two ticks in a row with nothing claimed while jobs are due still count."""
    out = []
    aged = [(s, s.oldest_due_age) for s in samples if s.oldest_due_age is not None]
    for (a, age_a), (b, age_b) in itertools.pairwise(aged):
        rise = age_b - age_a
        if rise <= tolerance:
            continue
        followed = b.budget == 0 and a.claimed > 0  # the late tick's next, with no budget
        raced = b.due == a.due and (b.claimed > 0 or followed) and rise <= (b.t - a.t) + 0.05
        if not raced:
            out.append((b.t, rise))
    return out


def concurrency(calls: Sequence[Mapping[str, Any]]) -> int:
    """Most upstream calls in progress at once, from the workers' call logs."""
    edges: dict[tuple[Any, ...], list[float]] = defaultdict(list)
    for c in calls:
        edges[(c["pid"], c["job_id"], c["attempt"])].append(float(c["t"]))
    events = []
    for times in edges.values():
        if len(times) >= 2:
            events += [(min(times), 1), (max(times), -1)]
    level = peak = 0
    for _t, d in sorted(events):
        level += d
        peak = max(peak, level)
    return peak


def keep_logs(rig: Rig, destination: Path) -> None:
    """Copies the run's logs (for a failing test or the benchmark's record)."""
    shutil.copytree(rig.workdir / "logs", destination, dirs_exist_ok=True)
