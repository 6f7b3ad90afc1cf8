"""The ledger: the only module of the daemon that sends SQL.

It owns the asyncpg pool, the migrations and the daemon's private statements,
loaded once from ``sql/queries.sql`` (one method per named block, same name;
the migration runner's bookkeeping statements are sent by name).
Callers get frozen dataclasses from ``models.py``, never asyncpg records, and
``PacerdError``s, never asyncpg exceptions: every driver error is translated
here with ``raise ... from exc``.
"""

from __future__ import annotations

import contextlib
import functools
import json
import re
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import asyncpg
import structlog
from asyncpg.pool import PoolConnectionProxy

from pacerd.errors import LedgerError, LedgerRejected, LedgerUnavailable, MigrationError
from pacerd.models import (
    ClaimedJob,
    ClaimRequest,
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
    from collections.abc import (
        AsyncIterator,
        Awaitable,
        Callable,
        Iterable,
        Iterator,
        Sequence,
    )


Conn = asyncpg.Connection | PoolConnectionProxy

LEADER_APPLICATION_NAME = "pacerd:leader"  # the leadership sessions (pacerd.leadership)
DEFAULT_PARTITIONS = 64
MAX_PARTITIONS = 4096
# Every statement pacerd sends is short and its plan's cost is a guess (arrays
# unnested, CTEs): over jit_above_cost, PostgreSQL compiled the claim for
# ~0.6 s on every call, while it ran in ~0.2 ms. JIT pays only on long
# analytic queries.
SESSION_SETTINGS = {"jit": "off"}
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
    """The named blocks of ``sql/queries.sql`` (parsed once; a fresh dict each call)."""
    return dict(_parse_queries())


@functools.cache
def _parse_queries() -> dict[str, Query]:
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


async def _roll_back_only(conn: asyncpg.Connection) -> None:
    """A stateless pool (the daemon's ledger, a worker's currency checks)
    resets nothing on release beyond the open transaction asyncpg rolls back
    itself: its sessions keep no state (no SET, LISTEN, cursor or session
    advisory lock: leadership and migrations use connections of their own),
    and the default reset
    (``pg_advisory_unlock_all(); CLOSE ALL; UNLISTEN *; RESET ALL``) was
    one more round trip, and one more transaction, for every statement."""


async def connect_pool(
    dsn: str,
    *,
    min_size: int = 1,
    max_size: int = 8,
    connect_timeout: float = 10.0,
    stateless: bool = False,
) -> asyncpg.Pool:
    """An asyncpg pool with pacerd's settings. ``stateless``: the caller
    keeps no session state on its connections, so releasing one sends no
    reset (``_roll_back_only``)."""
    with translate_errors():
        pool: asyncpg.Pool = await asyncpg.create_pool(
            dsn,
            min_size=min_size,
            max_size=max_size,
            timeout=connect_timeout,
            command_timeout=60,
            init=_init_connection,
            reset=_roll_back_only if stateless else None,
            server_settings=dict(SESSION_SETTINGS),
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
    queries = load_queries()
    applied: list[str] = []
    try:
        conn: asyncpg.Connection = await asyncpg.connect(dsn, timeout=10)
    except (OSError, asyncpg.PostgresError, TimeoutError) as exc:
        raise LedgerUnavailable(f"the ledger cannot be reached: {exc}") from exc
    try:
        with translate_errors():
            await conn.execute(queries["migration_lock"].sql, MIGRATION_LOCK_KEY)
            await conn.execute(queries["create_schema"].sql)
            await conn.execute(queries["create_migrations_table"].sql)
            done = {r["version"] for r in await conn.fetch(queries["applied_migrations"].sql)}
            for version, name, sql in migration_files():
                if version in done:
                    continue
                try:
                    async with conn.transaction():
                        await conn.execute(sql)
                        await conn.execute(queries["record_migration"].sql, version, name)
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
            if notice is not None and await conn.fetchval(queries["is_superuser"].sql):
                notice(
                    "the pacerd functions run with the rights of their owner, a superuser:"
                    " run `pacerd migrate` and `pacerd run` as a dedicated role"
                )
    finally:
        with contextlib.suppress(Exception):
            await conn.execute(queries["migration_unlock"].sql, MIGRATION_LOCK_KEY)
        await conn.close()
    return applied


async def pending_migrations(pool: asyncpg.Pool) -> list[str]:
    queries = load_queries()
    with translate_errors():
        exists = await pool.fetchval(queries["migrations_table_exists"].sql)
        done: set[int] = set()
        if exists:
            done = {r["version"] for r in await pool.fetch(queries["applied_migrations"].sql)}
    return [name for version, name, _ in migration_files() if version not in done]


# ---------------------------------------------------------------------------
# The daemon's statements
# ---------------------------------------------------------------------------


def _refs_arrays(refs: Sequence[JobRef]) -> tuple[list[str], list[int]]:
    return [r.job_id for r in refs], [r.attempt for r in refs]


class PersistedObject(Mapping[str, Any]):
    """A JSON object persisted as text (a destination's pacer state), decoded
    when first read: every tick reads its destination's row, but its
    admission loads the state only on its first tick and merges it only into
    a cut's. Anything but a JSON object reads as empty (never raises)."""

    __slots__ = ("_text", "_value")

    def __init__(self, text: str) -> None:
        self._text = text
        self._value: dict[str, Any] | None = None

    def _decoded(self) -> dict[str, Any]:
        if self._value is None:
            try:
                value = json.loads(self._text)
            except ValueError:
                value = None
            self._value = value if isinstance(value, dict) else {}
        return self._value

    def __getitem__(self, key: str) -> Any:
        return self._decoded()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._decoded())

    def __len__(self) -> int:
        return len(self._decoded())

    def __repr__(self) -> str:
        return f"PersistedObject({self._decoded()!r})"


def _destination_row(r: asyncpg.Record) -> DestinationRow:
    return DestinationRow(
        destination=r["destination"],
        paused=r["paused"],
        paused_all=r["paused_all"],
        cooldown_until=r["cooldown_until"],
        epoch=r["epoch"],
        pacer_state=PersistedObject(r["pacer_state"]) if r["pacer_state"] else None,
        n_accepted=r["n_accepted"],
        n_refused=r["n_refused"],
        n_accepted_fresh=r["n_accepted_fresh"],
        n_refused_fresh=r["n_refused_fresh"],
        n_retry_after=r["n_retry_after"],
        leader=r["leader"],
        leader_since=r["leader_since"],
        now=r["now"],
        inflight=r.get("inflight"),
    )


class Ledger:
    """The daemon's view of the ledger, over one asyncpg pool."""

    def __init__(self, pool: asyncpg.Pool) -> None:
        self.pool = pool
        self.queries = load_queries()
        # The named statements sent, by name (a retry of one counts once):
        # ``pacerd.ledger.statements`` on the metrics.
        self.statements: Counter[str] = Counter()

    @classmethod
    async def connect(cls, dsn: str, *, max_size: int = 8, connect_timeout: float = 10.0) -> Ledger:
        pool = await connect_pool(
            dsn, max_size=max_size, connect_timeout=connect_timeout, stateless=True
        )
        return cls(pool)

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self.pool.close()

    def _sql(self, name: str) -> str:
        """The text of the named statement about to be sent (and counted)."""
        self.statements[name] += 1
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

    async def prepare(self, retry: RetrySettings, destinations: Iterable[str]) -> None:
        """What ``pacerd run`` needs of the ledger before it starts: migrated
        (else ``MigrationError``), the SQL API's limits stored from the
        config, and the configured destinations registered."""
        pending = await pending_migrations(self.pool)
        if pending:
            raise MigrationError(
                f"the ledger schema is not up to date ({', '.join(pending)} pending):"
                " run `pacerd migrate` first"
            )
        await self.write_settings(settings_from_retry(retry))
        for destination in destinations:
            await self.ensure_destination(destination)

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
        request = ClaimRequest(
            destination=destination, live_limit=live_limit, limit=limit,
            claim_seconds=claim_seconds, epoch=epoch, live_window_seconds=live_window_seconds,
        )  # fmt: skip
        claimed = await self.claim_due_many([request], instance=instance, now=now)
        return claimed.get(destination, [])

    async def claim_due_many(
        self, requests: Sequence[ClaimRequest], *, instance: str, now: dt.datetime | None = None
    ) -> dict[str, list[ClaimedJob]]:
        """One claim statement for many destinations (one request each, taken
        in name order); their claimed jobs by destination, oldest first."""
        wanted = sorted((r for r in requests if r.limit > 0), key=lambda r: r.destination)
        if not wanted:
            return {}
        if len({r.destination for r in wanted}) != len(wanted):
            raise ValueError("one claim request per destination")
        rows = await self._fetch(
            "claim_due",
            [r.destination for r in wanted],
            [max(0, r.live_limit) for r in wanted],
            [r.limit for r in wanted],
            [r.claim_seconds for r in wanted],
            [r.epoch for r in wanted],
            [r.live_window_seconds for r in wanted],
            now,
            instance,
        )
        claimed: dict[str, list[ClaimedJob]] = {}
        for r in rows:
            claimed.setdefault(r["destination"], []).append(
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
            )
        return claimed

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
        return (await self.has_due_many([(destination, at_least)], now))[0]

    async def has_due_many(
        self, asks: Sequence[tuple[str, int]], now: dt.datetime | None = None
    ) -> list[int]:
        """``has_due`` for each (destination, at_least) of ``asks``, in one
        statement (the one both send); the counts in the order asked."""
        if not asks:
            return []
        rows = await self._fetch(
            "has_due_many", [name for name, _ in asks], [n for _, n in asks], now
        )
        return [int(r["n"]) for r in rows]

    async def list_destinations(self, now: dt.datetime | None = None) -> list[DestinationRow]:
        return [_destination_row(r) for r in await self._fetch("list_destinations", now)]

    async def read_destination(
        self, destination: str, now: dt.datetime | None = None, *, inflight: bool = False
    ) -> DestinationRow | None:
        rows = await self.read_destinations([destination], now, inflight=inflight)
        return rows.get(destination)

    async def read_destinations(
        self,
        destinations: Sequence[str],
        now: dt.datetime | None = None,
        *,
        inflight: bool = False,
    ) -> dict[str, DestinationRow]:
        """The rows of ``destinations`` (absent: unknown); with ``inflight``,
        each with its claimed and offered jobs counted in the same statement."""
        rows = await self._fetch("read_destination", list(destinations), now, inflight)
        return {r["destination"]: _destination_row(r) for r in rows}

    async def closed_destinations(self, now: dt.datetime | None = None) -> dict[str, float | None]:
        """The paused and cooling-down destinations ("*" when all are paused),
        each with the seconds its cool-down has left (None: paused, closed
        until resumed): two small index scans, whatever the number of
        destinations."""
        closed: dict[str, float | None] = {}
        for r in await self._fetch("closed_destinations", now):
            name, left = r["destination"], r["left_seconds"]
            paused = name in closed and closed[name] is None
            closed[name] = None if paused else left  # paused and cooling down: paused
        return closed

    async def is_closed(self, destination: str) -> bool:
        row = await self.read_destination(destination)
        return row is not None and row.closed

    async def wake_destinations(
        self, partitions: Sequence[int], now: dt.datetime | None = None
    ) -> list[tuple[str, int]]:
        """(destination, partition) of every destination of ``partitions``
        that needs its leader now: the active ones and those whose next job
        has come due (one index scan; idle ones cost nothing)."""
        if not partitions:
            return []
        rows = await self._fetch("wake_destinations", list(partitions), now)
        return [(r["destination"], r["partition"]) for r in rows]

    async def lock_parking(self, conn: Conn, destinations: Sequence[str]) -> None:
        """Locks the destinations about to be parked (name order), in ``conn``'s transaction."""
        await conn.fetch(self._sql("lock_parking"), sorted(set(destinations)))

    async def park_destinations(
        self, destinations: Sequence[str], now: dt.datetime | None = None
    ) -> set[str]:
        """Parks those of ``destinations`` with nothing due, nothing in flight
        and no cool-down: their leader plans them no more until a job of theirs
        comes due. Returns the parked ones."""
        if not destinations:
            return set()
        names = sorted(set(destinations))

        async def park() -> set[str]:
            async with self.pool.acquire() as conn, conn.transaction():
                await self.lock_parking(conn, names)
                rows = await conn.fetch(self._sql("park_destinations"), names, now)
            return {r["destination"] for r in rows}

        with translate_errors():
            return await retry_transient("park_destinations", park)

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
        await self.save_pacer_states([(destination, state, epoch)], now)

    async def save_pacer_states(
        self,
        states: Sequence[tuple[str, Mapping[str, Any], int]],
        now: dt.datetime | None = None,
    ) -> None:
        """Persists (destination, pacer state, epoch) of many destinations in
        one statement; a destination named twice keeps its last state."""
        last = {destination: (state, epoch) for destination, state, epoch in states}
        if not last:
            return
        names = list(last)
        await self._fetch(
            "save_pacer_state",
            names,
            [json.dumps(dict(last[n][0])) for n in names],
            [last[n][1] for n in names],
            now,
        )

    async def set_leader(
        self, partition: int, leader: str | None, now: dt.datetime | None = None
    ) -> None:
        """Records who leads ``partition`` (None: nobody), for status."""
        await self._fetch("set_leader", partition, leader, now)

    async def set_partitions(self, partitions: int) -> None:
        """Sets how many partitions destinations hash into and places every
        destination again. Instances read the number when they start, so it
        is refused while any of them runs (a leadership session is connected)."""
        if not 1 <= partitions <= MAX_PARTITIONS:
            raise ValueError(f"partitions must be between 1 and {MAX_PARTITIONS}, got {partitions}")
        with translate_errors():
            async with self.pool.acquire() as conn, conn.transaction():
                await conn.execute(self._sql("migration_xact_lock"), MIGRATION_LOCK_KEY)
                current = await conn.fetchval(self._sql("read_partitions"))
                if current == partitions:
                    return
                running = await conn.fetchval(self._sql("count_instances"), LEADER_APPLICATION_NAME)
                if running:
                    raise LedgerRejected(
                        f"the ledger's partitions stay {current}: {running} pacerd instance(s)"
                        " run on it; stop them all, then change --partitions"
                    )
                await conn.execute(self._sql("set_partitions"), partitions)

    async def read_partitions(self) -> int:
        """How many partitions the ledger's destinations hash into."""
        rows = await self._fetch("read_partitions")
        return int(rows[0]["partitions"]) if rows else DEFAULT_PARTITIONS

    async def due_summary(
        self, now: dt.datetime | None = None, *, woken_only: bool = False
    ) -> list[DueSummary]:
        return [
            DueSummary(
                destination=r["destination"],
                due=r["due"],
                oldest_scheduled_at=r["oldest_due_at"],
                inflight=r["inflight"],
                dead=r["dead"],
            )
            for r in await self._fetch("due_summary", now, woken_only)
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
                # one statement: atomic in its own implicit transaction, without
                # the two round trips of a BEGIN and a COMMIT around it
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
