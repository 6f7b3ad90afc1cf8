"""The ledger: the only module of the daemon that sends SQL.

It owns the asyncpg pool, the migrations and the daemon's private statements,
loaded once from ``sql/queries.sql`` (one method per named block, same name).
Callers get frozen dataclasses from ``models.py``, never asyncpg records, and
``PacerdError``s, never asyncpg exceptions: every driver error is translated
here with ``raise ... from exc``.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
from dataclasses import dataclass
from importlib import resources
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import anyio
import asyncpg
import structlog
from asyncpg.pool import PoolConnectionProxy

from pacerd.clock import SystemClock
from pacerd.errors import LedgerError, LedgerRejected, LedgerUnavailable, MigrationError
from pacerd.models import (
    ClaimedJob,
    DestinationRow,
    DueSummary,
    JobRef,
    JobState,
    ReclaimedJob,
    Report,
)
from pacerd.roles import RoleNames, grants_sql

if TYPE_CHECKING:
    import datetime as dt
    from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence

    from pacerd.clock import Clock

Conn = asyncpg.Connection | PoolConnectionProxy

MIGRATION_LOCK_KEY = 0x7061636572  # "pacer": serialises concurrent `pacerd migrate` runs
_MIGRATION_NAME = re.compile(r"^(\d{4})_[a-z0-9_]+\.sql$")
_UNAVAILABLE_STATES = {"57P01", "57P02", "57P03", "53300", "08000", "08003", "08006", "08001"}
# A deadlock victim or a serialization failure: PostgreSQL rolled the whole
# transaction back, so running it again is safe, and usually succeeds.
_TRANSIENT_STATES = frozenset({"40P01", "40001"})

log = structlog.get_logger("pacerd.ledger")
_T = TypeVar("_T")


@dataclass(frozen=True, slots=True)
class Query:
    name: str
    description: str
    sql: str


def load_queries() -> dict[str, Query]:
    """Parses ``sql/queries.sql`` into named blocks."""
    text = resources.files("pacerd.sql").joinpath("queries.sql").read_text(encoding="utf-8")
    queries: dict[str, Query] = {}
    for block in re.split(r"^-- name: ", text, flags=re.MULTILINE)[1:]:
        name, rest = block.split("\n", 1)
        description, sql = rest.split("\n", 1)
        queries[name.strip()] = Query(
            name=name.strip(), description=description.removeprefix("-- ").strip(), sql=sql.strip()
        )
    return queries


@contextlib.contextmanager
def translate_errors() -> Iterator[None]:
    """Turns asyncpg and socket errors into the PacerdError hierarchy."""
    try:
        yield
    except asyncpg.PostgresError as exc:
        state = getattr(exc, "sqlstate", None) or ""
        if state == "22023":
            raise LedgerRejected(str(exc)) from exc
        if state in _UNAVAILABLE_STATES or state.startswith("08"):
            raise LedgerUnavailable(f"the ledger went away: {exc}") from exc
        raise LedgerError(f"ledger error [{state}]: {exc}") from exc
    except (OSError, asyncpg.InterfaceError, asyncpg.InternalClientError, TimeoutError) as exc:
        raise LedgerUnavailable(f"the ledger cannot be reached: {exc}") from exc


async def retry_transient(name: str, attempt: Callable[[], Awaitable[_T]]) -> _T:
    """Runs one statement or transaction, and once more if PostgreSQL aborted
    it as a deadlock victim or a serialization failure (a second such
    failure is raised). Every retry in the ledger goes through here."""
    try:
        return await attempt()
    except asyncpg.PostgresError as exc:
        state = getattr(exc, "sqlstate", None) or ""
        if state not in _TRANSIENT_STATES:
            raise
        log.warning("ledger_retried", query=name, sqlstate=state, error=str(exc).split("\n")[0])
    return await attempt()


async def _init_connection(conn: asyncpg.Connection) -> None:
    for typename in ("json", "jsonb"):
        await conn.set_type_codec(
            typename, encoder=json.dumps, decoder=json.loads, schema="pg_catalog"
        )


async def connect_pool(
    dsn: str, *, min_size: int = 1, max_size: int = 8, connect_timeout: float = 10.0
) -> asyncpg.Pool:
    with translate_errors():
        pool: asyncpg.Pool = await asyncpg.create_pool(
            dsn,
            min_size=min_size,
            max_size=max_size,
            timeout=connect_timeout,
            command_timeout=60,
            init=_init_connection,
        )
        return pool


class RetrySettings(Protocol):
    max_attempts: int
    backoff_base_seconds: float
    backoff_cap_seconds: float
    payload_max_bytes: int


def settings_from_retry(retry: RetrySettings) -> dict[str, object]:
    """The `[retry]` limits the SQL functions enforce, as `pacerd.settings` rows."""
    return {
        "max_attempts": retry.max_attempts,
        "backoff_base_seconds": retry.backoff_base_seconds,
        "backoff_cap_seconds": retry.backoff_cap_seconds,
        "payload_max_bytes": retry.payload_max_bytes,
    }


# ---------------------------------------------------------------------------
# Migrations
# ---------------------------------------------------------------------------


def migration_files() -> list[tuple[int, str, str]]:
    """(version, name, sql) of every shipped migration, in order."""
    folder = resources.files("pacerd.sql").joinpath("migrations")
    found = []
    for entry in folder.iterdir():
        match = _MIGRATION_NAME.match(entry.name)
        if match:
            found.append((int(match.group(1)), entry.name, entry.read_text(encoding="utf-8")))
    found.sort()
    versions = [v for v, _, _ in found]
    if len(set(versions)) != len(versions):
        raise MigrationError(f"two migrations share a version number: {versions}")
    return found


async def migrate(
    dsn: str,
    *,
    roles: RoleNames | None = None,
    create_roles: bool = True,
    notice: Callable[[str], None] | None = None,
) -> list[str]:
    """Applies pending migrations, each in its own transaction, under an
    advisory lock, then (re-)asserts the roles' grants (``pacerd.roles``);
    returns the names applied (empty when up to date). ``notice`` receives
    the server's notices and warnings about the setup."""
    roles = roles or RoleNames()
    applied: list[str] = []
    try:
        conn: asyncpg.Connection = await asyncpg.connect(dsn, timeout=10)
    except (OSError, asyncpg.PostgresError, TimeoutError) as exc:
        raise LedgerUnavailable(f"the ledger cannot be reached: {exc}") from exc
    try:
        with translate_errors():
            await conn.execute("SELECT pg_advisory_lock($1)", MIGRATION_LOCK_KEY)
            await conn.execute(
                "CREATE SCHEMA IF NOT EXISTS pacerd;"
                "CREATE TABLE IF NOT EXISTS pacerd.migrations ("
                " version integer PRIMARY KEY, name text NOT NULL,"
                " applied_at timestamptz NOT NULL DEFAULT now())"
            )
            done = {r["version"] for r in await conn.fetch("SELECT version FROM pacerd.migrations")}
            for version, name, sql in migration_files():
                if version in done:
                    continue
                try:
                    async with conn.transaction():
                        await conn.execute(sql)
                        await conn.execute(
                            "INSERT INTO pacerd.migrations (version, name) VALUES ($1, $2)",
                            version,
                            name,
                        )
                except asyncpg.PostgresError as exc:
                    raise MigrationError(f"migration {name} failed: {exc}") from exc
                applied.append(name)
            if notice is not None:
                conn.add_log_listener(lambda _conn, message: notice(str(message.message)))
            try:
                async with conn.transaction():
                    await conn.execute(grants_sql(roles, create_roles=create_roles))
            except asyncpg.PostgresError as exc:
                raise MigrationError(
                    f"granting the roles failed: {exc} (where roles are made elsewhere,"
                    " create them there and use `pacerd migrate --no-roles`)"
                ) from exc
            if notice is not None and await conn.fetchval(
                "SELECT rolsuper FROM pg_catalog.pg_roles WHERE rolname = current_user"
            ):
                notice(
                    "the pacerd functions run with the rights of their owner, a superuser:"
                    " run `pacerd migrate` and `pacerd run` as a dedicated role"
                )
    finally:
        with contextlib.suppress(Exception):
            await conn.execute("SELECT pg_advisory_unlock($1)", MIGRATION_LOCK_KEY)
        await conn.close()
    return applied


async def pending_migrations(pool: asyncpg.Pool) -> list[str]:
    with translate_errors():
        exists = await pool.fetchval("SELECT to_regclass('pacerd.migrations') IS NOT NULL")
        done: set[int] = set()
        if exists:
            done = {r["version"] for r in await pool.fetch("SELECT version FROM pacerd.migrations")}
    return [name for version, name, _ in migration_files() if version not in done]


# ---------------------------------------------------------------------------
# The daemon's statements
# ---------------------------------------------------------------------------


def _refs_arrays(refs: Sequence[JobRef]) -> tuple[list[str], list[int]]:
    return [r.job_id for r in refs], [r.attempt for r in refs]


def _json_object(text: str | None) -> dict[str, Any] | None:
    """A persisted JSON object, or None for anything else (never raises)."""
    if not text:
        return None
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _destination_row(r: asyncpg.Record) -> DestinationRow:
    return DestinationRow(
        destination=r["destination"],
        paused=r["paused"],
        paused_all=r["paused_all"],
        cooldown_until=r["cooldown_until"],
        epoch=r["epoch"],
        pacer_state=_json_object(r["pacer_state"]),
        n_accepted=r["n_accepted"],
        n_refused=r["n_refused"],
        n_accepted_fresh=r["n_accepted_fresh"],
        n_refused_fresh=r["n_refused_fresh"],
        n_retry_after=r["n_retry_after"],
        leader=r["leader"],
        leader_since=r["leader_since"],
        now=r["now"],
    )


class Ledger:
    """The daemon's view of the ledger, over one asyncpg pool."""

    def __init__(self, pool: asyncpg.Pool) -> None:
        self.pool = pool
        self.queries = load_queries()

    @classmethod
    async def connect(cls, dsn: str, *, max_size: int = 8, connect_timeout: float = 10.0) -> Ledger:
        return cls(await connect_pool(dsn, max_size=max_size, connect_timeout=connect_timeout))

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self.pool.close()

    def _sql(self, name: str) -> str:
        return self.queries[name].sql

    async def _fetch(self, name: str, *args: Any) -> list[asyncpg.Record]:
        sql = self._sql(name)

        async def fetch() -> list[asyncpg.Record]:
            rows: list[asyncpg.Record] = await self.pool.fetch(sql, *args)
            return rows

        with translate_errors():
            return await retry_transient(name, fetch)

    @contextlib.asynccontextmanager
    async def transaction(self) -> AsyncIterator[Conn]:
        with translate_errors():
            async with self.pool.acquire() as conn, conn.transaction():
                yield conn

    async def claim_due(
        self,
        destination: str,
        *,
        live_limit: int,
        limit: int,
        claim_seconds: float,
        epoch: int,
        live_window_seconds: float,
        instance: str,
        now: dt.datetime | None = None,
    ) -> list[ClaimedJob]:
        if limit <= 0:
            return []
        rows = await self._fetch(
            "claim_due",
            destination,
            max(0, live_limit),
            limit,
            claim_seconds,
            epoch,
            live_window_seconds,
            now,
            instance,
        )
        return [
            ClaimedJob(
                job_id=r["job_id"],
                kind=r["kind"],
                destination=r["destination"],
                attempt=r["attempt"],
                revision=r["revision"],
                payload_json=r["payload"],
                cursor_json=r["cursor"],
                eligible_at=r["next_attempt_at"],
                live=r["live"],
            )
            for r in rows
        ]

    async def mark_offered(
        self, refs: Sequence[JobRef], *, offer_seconds: float, now: dt.datetime | None = None
    ) -> list[JobRef]:
        if not refs:
            return []
        ids, attempts = _refs_arrays(refs)
        rows = await self._fetch("mark_offered", ids, attempts, offer_seconds, now)
        return [JobRef(job_id=r["job_id"], attempt=r["attempt"]) for r in rows]

    async def release_claims(
        self, refs: Sequence[JobRef], *, reason: str, now: dt.datetime | None = None
    ) -> list[JobRef]:
        if not refs:
            return []
        ids, attempts = _refs_arrays(refs)
        rows = await self._fetch("release_claims", ids, attempts, reason, now)
        return [JobRef(job_id=r["job_id"], attempt=r["attempt"]) for r in rows]

    async def reclaim_expired(
        self, *, limit: int, now: dt.datetime | None = None
    ) -> list[ReclaimedJob]:
        rows = await self._fetch("reclaim_expired", now, limit)
        return [
            ReclaimedJob(
                job_id=r["job_id"],
                attempt=r["attempt"],
                destination=r["destination"],
                previous_state=JobState(r["previous_state"]),
                state=JobState(r["state"]),
            )
            for r in rows
        ]

    async def count_inflight(self, destination: str) -> int:
        rows = await self._fetch("count_inflight", destination)
        return int(rows[0]["inflight"])

    async def oldest_due(
        self, destination: str, now: dt.datetime | None = None
    ) -> dt.datetime | None:
        rows = await self._fetch("oldest_due", destination, now)
        value: dt.datetime | None = rows[0]["oldest_due_at"]
        return value

    async def has_due(
        self, destination: str, *, at_least: int = 1, now: dt.datetime | None = None
    ) -> int:
        """Counts due jobs up to ``at_least`` (a bounded scan, cheap on any backlog)."""
        rows = await self._fetch("has_due", destination, at_least, now)
        return int(rows[0]["n"])

    async def list_destinations(self, now: dt.datetime | None = None) -> list[DestinationRow]:
        return [_destination_row(r) for r in await self._fetch("list_destinations", now)]

    async def read_destination(
        self, destination: str, now: dt.datetime | None = None
    ) -> DestinationRow | None:
        rows = await self._fetch("read_destination", destination, now)
        return _destination_row(rows[0]) if rows else None

    async def ensure_destination(self, destination: str) -> None:
        await self._fetch("ensure_destination", destination)

    async def save_pacer_state(
        self,
        destination: str,
        state: Mapping[str, Any],
        *,
        epoch: int,
        now: dt.datetime | None = None,
    ) -> None:
        await self._fetch("save_pacer_state", destination, dict(state), epoch, now)

    async def set_leader(
        self, destination: str, leader: str | None, now: dt.datetime | None = None
    ) -> None:
        await self._fetch("set_leader", destination, leader, now)

    async def due_summary(self, now: dt.datetime | None = None) -> list[DueSummary]:
        return [
            DueSummary(
                destination=r["destination"],
                due=r["due"],
                oldest_scheduled_at=r["oldest_due_at"],
                inflight=r["inflight"],
                dead=r["dead"],
            )
            for r in await self._fetch("due_summary", now)
        ]

    async def write_settings(self, settings: Mapping[str, object]) -> None:
        keys = list(settings)
        await self._fetch("write_settings", keys, [settings[k] for k in keys])

    async def apply_reports(self, reports: Sequence[Report]) -> list[str]:
        """Applies outcome reports through ``pacerd.report`` in one transaction
        and returns each result ('applied', 'stale', 'unknown', or 'rejected:
        <why>' for a report the SQL API refused). A rejected report does not
        undo the others: the batch retries row by row under savepoints."""
        if not reports:
            return []
        with translate_errors():
            return await retry_transient("apply_reports", lambda: self._apply_reports(reports))

    async def lock_reported(self, conn: Conn, job_ids: Sequence[str]) -> None:
        """Locks the named jobs, then their destinations, in the lock order, in
        ``conn``'s transaction: reports applied one statement each then wait
        for no lock midway. An id PostgreSQL cannot hold as text (a NUL) names
        no job; its report is rejected on its own."""
        await conn.fetch(self._sql("lock_reported"), [j for j in job_ids if "\x00" not in j])

    async def _apply_reports(self, reports: Sequence[Report]) -> list[str]:
        sql = self._sql("apply_reports")
        async with self.pool.acquire() as conn:
            try:
                async with conn.transaction():
                    return await _report_batch(conn, sql, reports)
            except asyncpg.PostgresError as exc:
                if not (getattr(exc, "sqlstate", None) or "").startswith("22"):
                    raise
            results: list[str] = []
            async with conn.transaction():
                await self.lock_reported(conn, [r.job_id for r in reports])
                for report in reports:
                    try:
                        async with conn.transaction():
                            results.extend(await _report_batch(conn, sql, [report]))
                    except asyncpg.PostgresError as exc:
                        if not (getattr(exc, "sqlstate", None) or "").startswith("22"):
                            raise
                        results.append(f"rejected: {exc}")
            return results


async def _report_batch(conn: Conn, sql: str, reports: Sequence[Report]) -> list[str]:
    rows = await conn.fetch(
        sql,
        [r.job_id for r in reports],
        [r.attempt for r in reports],
        [str(r.outcome) for r in reports],
        [r.retry_after_s for r in reports],
        [r.error for r in reports],
        [r.detail for r in reports],
        [r.cursor for r in reports],
    )
    return [str(r["result"]) for r in rows]


# ---------------------------------------------------------------------------
# Leadership
# ---------------------------------------------------------------------------

LEADER_NAMESPACE = 0x70616365  # advisory-lock class id for "destination leadership"
RECONCILER_LOCK = "#reconciler"  # "#" is not allowed in a destination name
LEADER_APPLICATION_NAME = "pacerd:leader"
DEFAULT_LEASE_SECONDS = 5.0


class LeaderLocks:
    """Leadership per destination: PostgreSQL session advisory locks held on
    one dedicated connection (application_name ``pacerd:leader``).

    Two clocks bound who may act as a leader, and they are ordered:

    - PostgreSQL releases the locks the moment the session ends: at once when
      the process dies or the socket closes, and after ``2 * lease_seconds``
      of silence when the network is cut (the session's TCP keepalives and
      ``tcp_user_timeout`` are set from ``lease_seconds``).
    - This side trusts a lock for at most ``lease_seconds`` after the last
      round trip that proved the session alive (measured from when that
      probe was *sent*), and drops every lock at once when the connection
      reports its end (asyncpg's termination listener).

    So an instance cut off from the database stops acting as leader before
    PostgreSQL lets anyone else take its locks. ``wait_lost()`` renews the
    lease while it waits, so a leader does not depend on the supervisor's
    cadence to keep it.

    A destination being handed over (``begin_release``) is still locked but
    no longer led: the admission loop finishes its tick, then ``release()``
    unlocks it. ``try_acquire`` never locks a name twice (advisory locks are
    re-entrant within a session, and a second lock would outlive one unlock).
    """

    def __init__(
        self,
        dsn: str,
        *,
        instance: str,
        clock: Clock | None = None,
        lease_seconds: float = DEFAULT_LEASE_SECONDS,
    ) -> None:
        if lease_seconds <= 0:
            raise ValueError("lease_seconds must be > 0")
        self.dsn = dsn
        self.instance = instance
        self.clock: Clock = clock or SystemClock()
        self.lease_seconds = lease_seconds
        self._conn: asyncpg.Connection | None = None
        self._held: set[str] = set()
        self._releasing: set[str] = set()
        self._usable_at: dict[str, float] = {}
        self._confirmed_at = -math.inf
        self._io: anyio.Lock | None = None
        self._changed: anyio.Event | None = None

    # -- local view (no I/O) ---------------------------------------------------

    @property
    def probe_timeout_seconds(self) -> float:
        return self.lease_seconds / 2

    @property
    def backend_pid(self) -> int | None:
        """The lock session's server process id (for logs and fault tests)."""
        conn = self._conn
        return None if conn is None or conn.is_closed() else conn.get_server_pid()

    def _session_ok(self) -> bool:
        conn = self._conn
        if conn is None or conn.is_closed():
            return False
        return self.clock.monotonic() - self._confirmed_at <= self.lease_seconds

    @property
    def held(self) -> frozenset[str]:
        """The names this instance may act as leader of now."""
        if not self._session_ok():
            return frozenset()
        return frozenset(self._held - self._releasing)

    def holds(self, name: str) -> bool:
        return name in self.held

    def has_lock(self, name: str) -> bool:
        """Whether the lock of ``name`` is ours (led or being handed over)."""
        return name in self._held and self._session_ok()

    def releasing(self, name: str) -> bool:
        return name in self._releasing and name in self._held

    def usable_at(self, name: str) -> float | None:
        """When this instance may start admitting for ``name`` (monotonic), or
        None when it does not lead it."""
        return self._usable_at.get(name) if self.holds(name) else None

    def changed(self) -> anyio.Event:
        """An event set at the next change of what is held."""
        if self._changed is None:
            self._changed = anyio.Event()
        return self._changed

    def _notify(self) -> None:
        changed, self._changed = self._changed, None
        if changed is not None:
            changed.set()

    def _forget(self) -> None:
        self._held.clear()
        self._releasing.clear()
        self._usable_at.clear()
        self._notify()

    def _lock(self) -> anyio.Lock:
        if self._io is None:
            self._io = anyio.Lock()
        return self._io

    def _drop(self) -> None:
        """Gives the session up: every lock is lost here now, and PostgreSQL
        releases them when the socket closes (or the keepalives expire)."""
        conn, self._conn = self._conn, None
        self._forget()
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.terminate()

    # -- the session ------------------------------------------------------------

    async def connect(self) -> None:
        await self.close()
        lease = self.lease_seconds
        settings = {
            "application_name": LEADER_APPLICATION_NAME,
            # A cut network ends the session server-side after 2 * lease of
            # silence: later than this side stops trusting it (1 * lease).
            "tcp_keepalives_idle": str(max(1, math.ceil(lease))),
            "tcp_keepalives_interval": "1",
            "tcp_keepalives_count": str(max(1, math.ceil(lease))),
            "tcp_user_timeout": str(math.ceil(2000 * lease)),
        }
        sent = self.clock.monotonic()
        with translate_errors():
            conn = await asyncpg.connect(self.dsn, timeout=10, server_settings=settings)
        self._conn = conn
        self._confirmed_at = sent
        conn.add_termination_listener(self._on_terminated)

    def _on_terminated(self, conn: Conn) -> None:
        if conn is self._conn:
            self._forget()

    async def close(self) -> None:
        conn, self._conn = self._conn, None
        self._forget()
        if conn is not None:
            with contextlib.suppress(Exception):
                await conn.close(timeout=2)

    async def _query(self, sql: str, *args: Any) -> Any:
        """One statement on the lock session, serialised, bounded in time and
        shielded (a cancelled query must not disturb the session); a session
        that does not answer in time is given up."""
        conn = self._conn
        if conn is None:
            raise LedgerUnavailable("the leadership session is not connected")
        try:
            with anyio.CancelScope(shield=True):
                return await conn.fetchval(sql, *args, timeout=self.probe_timeout_seconds)
        except (
            asyncpg.InterfaceError,
            asyncpg.InternalClientError,
            OSError,
            TimeoutError,
            asyncpg.PostgresError,
        ) as exc:
            if conn is self._conn:
                self._drop()
            raise LedgerUnavailable(f"the leadership session failed: {exc}") from exc

    async def alive(self, *, timeout_seconds: float | None = None) -> bool:
        """Checks the lock session answers and renews the lease; on failure,
        drops every lock (and the session)."""
        conn = self._conn
        if conn is None or conn.is_closed():
            if self._held:
                self._forget()
            return False
        async with self._lock():
            if conn is not self._conn:
                return self._conn is not None
            sent = self.clock.monotonic()
            try:
                await self._query("SELECT 1")
            except LedgerUnavailable:
                return False
            self._confirmed_at = max(self._confirmed_at, sent)
        return True

    async def renew(self) -> bool:
        """Renews the lease unless a probe did so recently."""
        if self.clock.monotonic() - self._confirmed_at < self.lease_seconds / 4:
            return self._session_ok()
        return await self.alive()

    async def wait_lost(self, name: str) -> None:
        """Returns once the lock of ``name`` may no longer be ours (the session
        ended, or its lease lapsed); renews the lease meanwhile. A handover
        does not count: it ends between ticks (see ``begin_release``)."""
        while self.has_lock(name):
            now = self.clock.monotonic()
            renew_at = self._confirmed_at + self.lease_seconds / 4
            if now >= renew_at:
                with anyio.move_on_after(max(0.0, self._confirmed_at + self.lease_seconds - now)):
                    await self.renew()
                continue
            changed = self.changed()
            with anyio.move_on_after(renew_at - now):
                await changed.wait()

    # -- locks ---------------------------------------------------------------------

    async def try_acquire(self, name: str, *, settle_seconds: float = 0.0) -> bool:
        """Takes the lock of ``name`` if free; the new leader may admit after
        ``settle_seconds`` (``usable_at``)."""
        if name in self._held:
            return self.holds(name)
        if self._conn is None:
            return False
        async with self._lock():
            sent = self.clock.monotonic()
            got = bool(
                await self._query(
                    "SELECT pg_try_advisory_lock($1, hashtext($2))", LEADER_NAMESPACE, name
                )
            )
            self._confirmed_at = max(self._confirmed_at, sent)
        if got:
            self._held.add(name)
            self._usable_at[name] = self.clock.monotonic() + settle_seconds
            self._notify()
        return got

    def begin_release(self, name: str) -> None:
        """Stops leading ``name`` but keeps its lock until ``release()``."""
        if name in self._held:
            self._releasing.add(name)
            self._notify()

    async def release(self, name: str) -> None:
        """Unlocks ``name`` (this side forgets it first). If the unlock fails,
        the whole session is given up so the lock cannot linger."""
        self._releasing.discard(name)
        self._usable_at.pop(name, None)
        if name not in self._held:
            return
        self._held.discard(name)
        self._notify()
        if self._conn is None:
            return
        async with self._lock():
            await self._query("SELECT pg_advisory_unlock($1, hashtext($2))", LEADER_NAMESPACE, name)

    async def count_instances(self) -> int:
        """Live pacerd instances on this ledger: leadership sessions connected
        to this database (other databases of the cluster do not count)."""
        if self._conn is None:
            return 1
        async with self._lock():
            n = await self._query(
                "SELECT count(*) FROM pg_stat_activity"
                " WHERE application_name = $1 AND datname = current_database()",
                LEADER_APPLICATION_NAME,
            )
        return max(1, int(n or 0))
