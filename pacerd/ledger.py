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
import re
from dataclasses import dataclass
from importlib import resources
from typing import TYPE_CHECKING, Any, Protocol

import asyncpg
from asyncpg.pool import PoolConnectionProxy

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

if TYPE_CHECKING:
    import datetime as dt
    from collections.abc import AsyncIterator, Iterator, Mapping, Sequence

Conn = asyncpg.Connection | PoolConnectionProxy

MIGRATION_LOCK_KEY = 0x7061636572  # "pacer": serialises concurrent `pacerd migrate` runs
_MIGRATION_NAME = re.compile(r"^(\d{4})_[a-z0-9_]+\.sql$")
_UNAVAILABLE_STATES = {"57P01", "57P02", "57P03", "53300", "08000", "08003", "08006", "08001"}


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
    except (OSError, asyncpg.InterfaceError, TimeoutError) as exc:
        raise LedgerUnavailable(f"the ledger cannot be reached: {exc}") from exc


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


async def migrate(dsn: str) -> list[str]:
    """Applies pending migrations, each in its own transaction, under an
    advisory lock; returns the names applied (empty when up to date)."""
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
        with translate_errors():
            rows: list[asyncpg.Record] = await self.pool.fetch(self._sql(name), *args)
            return rows

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
        sql = self._sql("apply_reports")
        with translate_errors():
            async with self.pool.acquire() as conn:
                try:
                    async with conn.transaction():
                        return await _report_batch(conn, sql, reports)
                except asyncpg.PostgresError as exc:
                    if getattr(exc, "sqlstate", None) != "22023":
                        raise
                results: list[str] = []
                async with conn.transaction():
                    for report in reports:
                        try:
                            async with conn.transaction():
                                results.extend(await _report_batch(conn, sql, [report]))
                        except asyncpg.PostgresError as exc:
                            if getattr(exc, "sqlstate", None) != "22023":
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


class LeaderLocks:
    """Leadership per destination: PostgreSQL session advisory locks held on
    one dedicated connection. The database releases them the moment that
    session ends, so losing the connection loses leadership before any other
    instance can take it; ``alive()`` is checked before each pass, and a
    closed connection drops every lock locally at once."""

    def __init__(self, dsn: str, *, instance: str) -> None:
        self.dsn = dsn
        self.instance = instance
        self._conn: asyncpg.Connection | None = None
        self._held: set[str] = set()

    @property
    def held(self) -> frozenset[str]:
        if self._conn is None or self._conn.is_closed():
            self._held.clear()
        return frozenset(self._held)

    def holds(self, name: str) -> bool:
        return name in self.held

    async def connect(self) -> None:
        await self.close()
        with translate_errors():
            self._conn = await asyncpg.connect(
                self.dsn,
                timeout=10,
                server_settings={"application_name": LEADER_APPLICATION_NAME},
            )
        self._conn.add_termination_listener(lambda _conn: self._held.clear())

    async def close(self) -> None:
        conn, self._conn = self._conn, None
        self._held.clear()
        if conn is not None:
            with contextlib.suppress(Exception):
                await conn.close(timeout=2)

    async def alive(self, *, timeout_seconds: float = 2.0) -> bool:
        """Checks the lock session answers; on failure, drops every lock."""
        conn = self._conn
        if conn is None or conn.is_closed():
            self._held.clear()
            return False
        try:
            await conn.fetchval("SELECT 1", timeout=timeout_seconds)
        except (asyncpg.PostgresError, asyncpg.InterfaceError, OSError, TimeoutError):
            self._held.clear()
            with contextlib.suppress(Exception):
                conn.terminate()
            self._conn = None
            return False
        return True

    async def try_acquire(self, name: str) -> bool:
        if name in self.held:
            return True
        conn = self._conn
        if conn is None:
            return False
        with translate_errors():
            got = bool(
                await conn.fetchval(
                    "SELECT pg_try_advisory_lock($1, hashtext($2))", LEADER_NAMESPACE, name
                )
            )
        if got:
            self._held.add(name)
        return got

    async def release(self, name: str) -> None:
        conn = self._conn
        if conn is None or name not in self._held:
            return
        self._held.discard(name)
        with translate_errors():
            await conn.fetchval(
                "SELECT pg_advisory_unlock($1, hashtext($2))", LEADER_NAMESPACE, name
            )

    async def count_instances(self) -> int:
        """Live pacerd instances: sessions holding a leadership connection."""
        conn = self._conn
        if conn is None:
            return 1
        with translate_errors():
            n = await conn.fetchval(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1",
                LEADER_APPLICATION_NAME,
            )
        return max(1, int(n or 0))
