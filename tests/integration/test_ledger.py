"""The ledger against the real PostgreSQL: migrations, the SQL API and the
daemon's private statements.

The public functions are called through plain SQL with named arguments, the
way a producer in another language would (an asyncpg connection with no type
codecs: jsonb goes in and out as text); a few go through ``pacerd.client``.
The daemon's statements go through ``Ledger``. Time: the SQL API reads
``now()``; the daemon's statements take ``now=``, which pins claims and expires
leases without sleeping.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import math
from typing import TYPE_CHECKING, Any

import asyncpg
import pytest

from pacerd import ledger
from pacerd.client import Client, DeadFilter, dead_statement
from pacerd.errors import LedgerRejected
from pacerd.models import ClaimedJob, JobRef, JobState, Outcome, Report

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

pytestmark = pytest.mark.services

INSTANCE = "test-instance"
SLACK = dt.timedelta(milliseconds=500)  # Python's clock against PostgreSQL's now()
UTC = dt.UTC


def utcnow() -> dt.datetime:
    return dt.datetime.now(UTC)


def secs(n: float) -> dt.timedelta:
    return dt.timedelta(seconds=n)


# ---------------------------------------------------------------------------
# Helpers: an outside producer's SQL, and reads of the documented tables
# ---------------------------------------------------------------------------


@pytest.fixture
async def sql(db_dsn: str) -> AsyncIterator[asyncpg.Connection]:
    """A plain connection, no codecs: what a producer in any language has."""
    conn = await asyncpg.connect(db_dsn)
    yield conn
    await conn.close()


@pytest.fixture
async def client(db_dsn: str) -> AsyncIterator[Client]:
    c = await Client.connect(db_dsn, max_size=2)
    yield c
    await c.close()


async def schedule(
    conn: asyncpg.Connection,
    job_id: str,
    *,
    destination: str = "d",
    kind: str = "k",
    payload: str = "{}",
    eligible_at: dt.datetime | None = None,
    revision: int = 0,
    max_attempts: int | None = None,
) -> str:
    if eligible_at is None:  # the function's own DEFAULT now()
        result = await conn.fetchval(
            "SELECT pacerd.schedule(job_id => $1, kind => $2, destination => $3,"
            " payload => $4::jsonb, revision => $5, max_attempts => $6)",
            job_id,
            kind,
            destination,
            payload,
            revision,
            max_attempts,
        )
    else:
        result = await conn.fetchval(
            "SELECT pacerd.schedule(job_id => $1, kind => $2, destination => $3,"
            " payload => $4::jsonb, eligible_at => $5, revision => $6, max_attempts => $7)",
            job_id,
            kind,
            destination,
            payload,
            eligible_at,
            revision,
            max_attempts,
        )
    return str(result)


async def report(
    conn: asyncpg.Connection,
    job_id: str,
    attempt: int,
    outcome: str,
    *,
    retry_after_s: float | None = None,
    error: str | None = None,
    detail: dict[str, Any] | None = None,
    cursor: Any = None,
) -> str:
    result = await conn.fetchval(
        "SELECT pacerd.report(job_id => $1, attempt => $2, outcome => $3,"
        " retry_after_s => $4, error => $5, detail => $6::jsonb, cursor => $7::jsonb)",
        job_id,
        attempt,
        outcome,
        retry_after_s,
        error,
        None if detail is None else json.dumps(detail),
        None if cursor is None else json.dumps(cursor),
    )
    return str(result)


async def cancel(conn: asyncpg.Connection, job_id: str, reason: str | None = "test") -> str:
    return str(
        await conn.fetchval("SELECT pacerd.cancel(job_id => $1, reason => $2)", job_id, reason)
    )


async def replay(conn: asyncpg.Connection, job_id: str, reason: str | None = "fixed") -> str:
    return str(
        await conn.fetchval("SELECT pacerd.replay(job_id => $1, reason => $2)", job_id, reason)
    )


async def is_current(conn: asyncpg.Connection, job_id: str, attempt: int) -> bool:
    return bool(
        await conn.fetchval(
            "SELECT pacerd.is_current(job_id => $1, attempt => $2)", job_id, attempt
        )
    )


async def job(conn: asyncpg.Connection, job_id: str) -> dict[str, Any]:
    row = await conn.fetchrow("SELECT * FROM pacerd.jobs WHERE job_id = $1", job_id)
    assert row is not None, f"job {job_id} not found"
    out = dict(row)
    for key in ("payload", "cursor"):
        if out[key] is not None:
            out[key] = json.loads(out[key])
    return out


async def events(conn: asyncpg.Connection, job_id: str) -> list[tuple[str, int, dict[str, Any]]]:
    rows = await conn.fetch(
        "SELECT event, attempt, detail FROM pacerd.job_events WHERE job_id = $1 ORDER BY id", job_id
    )
    return [
        (r["event"], r["attempt"], json.loads(r["detail"]) if r["detail"] else {}) for r in rows
    ]


async def event_names(conn: asyncpg.Connection, job_id: str) -> list[str]:
    return [e for e, _, _ in await events(conn, job_id)]


async def test_a_revision_is_new_work_a_retry_is_backlog(
    ledger_: ledger.Ledger, sql: asyncpg.Connection
) -> None:
    """A job offered once is backlog when it is retried; a revision of it is
    new input, which has never been offered: live again while it is due
    within the live window."""
    await schedule(sql, "a", eligible_at=utcnow() - secs(1))
    first = await claim_one(ledger_, "a")
    assert first.live
    await offer(ledger_, [first])
    await report(sql, "a", first.attempt, "retry", error="flaky")
    retried = await claim_one(ledger_, "a", now=utcnow() + dt.timedelta(minutes=1))
    assert not retried.live  # offered before: backlog
    await offer(ledger_, [retried])
    assert await schedule(sql, "a", eligible_at=utcnow() - secs(1), revision=1) == "revised"
    revised = await claim_one(ledger_, "a")
    assert revised.live


async def destination(conn: asyncpg.Connection, name: str) -> dict[str, Any]:
    row = await conn.fetchrow("SELECT * FROM pacerd.destinations WHERE destination = $1", name)
    assert row is not None, f"destination {name} not found"
    return dict(row)


async def claim(
    led: ledger.Ledger,
    dest: str = "d",
    limit: int = 10,
    *,
    now: dt.datetime | None = None,
    live_limit: int = 0,
    live_window_seconds: float = 60.0,
    epoch: int = 0,
    claim_seconds: float = 30.0,
) -> list[ClaimedJob]:
    return await led.claim_due(
        dest,
        live_limit=live_limit,
        limit=limit,
        claim_seconds=claim_seconds,
        epoch=epoch,
        live_window_seconds=live_window_seconds,
        instance=INSTANCE,
        now=now,
    )


async def offer(
    led: ledger.Ledger,
    jobs: list[ClaimedJob],
    *,
    now: dt.datetime | None = None,
    offer_seconds: float = 60.0,
) -> list[JobRef]:
    return await led.mark_offered([j.ref for j in jobs], offer_seconds=offer_seconds, now=now)


async def claim_one(
    led: ledger.Ledger, job_id: str, dest: str = "d", *, now: dt.datetime | None = None
) -> ClaimedJob:
    """Claims due work of ``dest`` until ``job_id`` comes up, releasing the rest."""
    got = await claim(led, dest, limit=1000, now=now)
    mine = [j for j in got if j.job_id == job_id]
    others = [j.ref for j in got if j.job_id != job_id]
    if others:
        await led.release_claims(others, reason="test: not this one", now=now)
    assert mine, f"{job_id} was not claimable"
    return mine[0]


async def offered_job(
    led: ledger.Ledger, conn: asyncpg.Connection, job_id: str, **kw: Any
) -> ClaimedJob:
    """Schedules ``job_id`` (due now), claims and offers it."""
    assert await schedule(conn, job_id, eligible_at=utcnow() - secs(1), **kw) == "scheduled"
    c = await claim_one(led, job_id, kw.get("destination", "d"))
    assert await offer(led, [c]) == [c.ref]
    return c


async def rejection(conn: asyncpg.Connection, statement: str, *args: object) -> str:
    """Runs a statement that must be rejected as bad input (SQLSTATE 22023)."""
    with pytest.raises(asyncpg.PostgresError) as info:
        await conn.fetchval(statement, *args)
    assert info.value.sqlstate == "22023", info.value
    return str(info.value)


# ---------------------------------------------------------------------------
# Migrations
# ---------------------------------------------------------------------------


async def test_migrate_twice_is_a_noop(empty_db_dsn: str) -> None:
    first = await ledger.migrate(empty_db_dsn)
    assert first == [name for _, name, _ in ledger.migration_files()]
    assert await ledger.migrate(empty_db_dsn) == []


async def test_concurrent_migrates_of_one_database_apply_each_migration_once(
    empty_db_dsn: str,
) -> None:
    """Two ``pacerd migrate`` at once on one database: the advisory lock makes
    one apply every migration and the other find the schema up to date."""
    runs = await asyncio.gather(*(ledger.migrate(empty_db_dsn) for _ in range(2)))
    names = [name for _, name, _ in ledger.migration_files()]
    assert sorted(runs) == [[], names]
    conn = await asyncpg.connect(empty_db_dsn)
    try:
        assert await conn.fetchval("SELECT count(*) FROM pacerd.migrations") == len(names)
    finally:
        await conn.close()


async def test_every_named_query_prepares_on_a_migrated_database(empty_db_dsn: str) -> None:
    """Drift between queries.sql and the schema shows here, not in production
    (a template of the client's with every condition of a DeadFilter)."""
    await ledger.migrate(empty_db_dsn)
    every = DeadFilter(
        destination="d", kind="k", error_contains="e", dead_since=dt.datetime.now(dt.UTC)
    )
    conn = await asyncpg.connect(empty_db_dsn)
    try:
        for name, query in ledger.load_queries().items():
            sql = query.sql
            if "{where}" in sql:
                sql, _ = dead_statement(name, every, 3 if name == "replay_matching" else 1)
            try:
                await conn.prepare(sql)
            except asyncpg.PostgresError as exc:  # pragma: no cover - the failure message
                pytest.fail(f"{name} does not prepare: {exc}")
    finally:
        await conn.close()


SIGNATURES = {  # docs/protocol.md, "SQL API": names, argument names and result types
    "schedule": (
        "job_id text, kind text, destination text, payload jsonb,"
        " eligible_at timestamp with time zone DEFAULT now(), revision bigint DEFAULT 0,"
        " max_attempts integer DEFAULT NULL::integer",
        "text",
    ),
    "report": (
        "job_id text, attempt integer, outcome text,"
        " retry_after_s double precision DEFAULT NULL::double precision,"
        " error text DEFAULT NULL::text, detail jsonb DEFAULT NULL::jsonb,"
        " cursor jsonb DEFAULT NULL::jsonb",
        "text",
    ),
    "cancel": ("job_id text, reason text", "text"),
    "replay": ("job_id text, reason text", "text"),
    "is_current": ("job_id text, attempt integer", "boolean"),
    "pause": ("destination text DEFAULT NULL::text", "text"),
    "resume": ("destination text DEFAULT NULL::text", "text"),
}


async def test_public_functions_match_the_contract(sql: asyncpg.Connection) -> None:
    rows = await sql.fetch(
        "SELECT p.proname, pg_get_function_arguments(p.oid) AS args,"
        " pg_get_function_result(p.oid) AS result"
        " FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace"
        " WHERE n.nspname = 'pacerd' AND p.proname = ANY($1::text[])",
        list(SIGNATURES),
    )
    assert {r["proname"]: (r["args"], r["result"]) for r in rows} == SIGNATURES


# ---------------------------------------------------------------------------
# pacerd.schedule
# ---------------------------------------------------------------------------


async def test_schedule_new_job(sql: asyncpg.Connection) -> None:
    before = utcnow()
    assert await schedule(sql, "a", kind="send", destination="mail", payload='{"to": "x"}') == (
        "scheduled"
    )
    after = utcnow()
    row = await job(sql, "a")
    assert row["state"] == "scheduled"
    assert (row["kind"], row["destination"], row["payload"]) == ("send", "mail", {"to": "x"})
    assert (row["attempt"], row["failures"], row["revision"]) == (0, 0, 0)
    assert row["max_attempts"] == 10  # the default, from pacerd.settings
    assert before - SLACK <= row["next_attempt_at"] <= after + SLACK  # DEFAULT now()
    assert row["cursor"] is None
    assert row["last_error"] is None
    assert [(e, a) for e, a, _ in await events(sql, "a")] == [("scheduled", 0)]
    assert (await destination(sql, "mail"))["paused"] is False  # the destination is known


async def test_schedule_with_eligible_at_and_max_attempts(sql: asyncpg.Connection) -> None:
    at = dt.datetime(2031, 1, 2, 3, 4, 5, tzinfo=UTC)
    assert await schedule(sql, "a", eligible_at=at, max_attempts=3, revision=4) == "scheduled"
    row = await job(sql, "a")
    assert (row["next_attempt_at"], row["max_attempts"], row["revision"]) == (at, 3, 4)


async def test_schedule_same_or_lower_revision_is_unchanged(sql: asyncpg.Connection) -> None:
    assert await schedule(sql, "a", payload='{"v": 1}', revision=5) == "scheduled"
    assert await schedule(sql, "a", payload='{"v": 2}', revision=5) == "unchanged"
    assert await schedule(sql, "a", payload='{"v": 3}', revision=4) == "unchanged"
    assert await schedule(sql, "a", payload='{"v": 4}') == "unchanged"
    row = await job(sql, "a")
    assert (row["payload"], row["revision"]) == ({"v": 1}, 5)
    assert await event_names(sql, "a") == ["scheduled"]  # a repeat is not a transition


async def test_higher_revision_replaces_a_scheduled_job(sql: asyncpg.Connection) -> None:
    t1 = dt.datetime(2030, 1, 1, tzinfo=UTC)
    t2 = dt.datetime(2030, 6, 1, tzinfo=UTC)
    assert await schedule(sql, "a", payload='{"v": 1}', eligible_at=t1) == "scheduled"
    result = await schedule(
        sql, "a", kind="k2", destination="other", payload='{"v": 2}', eligible_at=t2, revision=1
    )
    assert result == "revised"
    row = await job(sql, "a")
    assert (row["state"], row["kind"], row["destination"]) == ("scheduled", "k2", "other")
    assert (row["payload"], row["next_attempt_at"], row["revision"]) == ({"v": 2}, t2, 1)
    names = await event_names(sql, "a")
    assert names == ["scheduled", "revised"]
    assert (await events(sql, "a"))[1][2]["previous_revision"] == 0
    await destination(sql, "other")  # the new destination is known too


async def test_revision_of_an_offered_job_makes_the_offer_stale(
    ledger_: ledger.Ledger, sql: asyncpg.Connection
) -> None:
    c = await offered_job(ledger_, sql, "a")
    assert await is_current(sql, "a", 1)
    assert await schedule(sql, "a", payload='{"v": 2}', revision=1) == "revised"
    row = await job(sql, "a")
    assert (row["state"], row["attempt"], row["lease_expires_at"]) == ("scheduled", 1, None)
    assert not await is_current(sql, "a", 1)
    assert await report(sql, "a", c.attempt, "ok") == "stale"
    assert (await job(sql, "a"))["state"] == "scheduled"
    again = await claim_one(ledger_, "a")
    assert again.attempt == 2  # a new message id: a:2
    assert json.loads(again.payload_json) == {"v": 2}
    assert again.revision == 1


async def test_revision_of_a_claimed_job_fences_its_confirm(
    ledger_: ledger.Ledger, sql: asyncpg.Connection
) -> None:
    await schedule(sql, "a", eligible_at=utcnow() - secs(1))
    c = await claim_one(ledger_, "a")
    assert await schedule(sql, "a", revision=1) == "revised"
    assert await offer(ledger_, [c]) == []  # the publish of the old revision confirms late
    assert await ledger_.release_claims([c.ref], reason="nack") == []
    assert (await job(sql, "a"))["state"] == "scheduled"


@pytest.mark.parametrize("closed", ["completed", "dead", "cancelled"])
async def test_higher_revision_restarts_a_closed_job(
    ledger_: ledger.Ledger, sql: asyncpg.Connection, closed: str
) -> None:
    c = await offered_job(ledger_, sql, "a")
    if closed == "completed":
        assert await report(sql, "a", c.attempt, "ok") == "applied"
    elif closed == "dead":
        assert await report(sql, "a", c.attempt, "fail", error="boom") == "applied"
    else:
        assert await cancel(sql, "a") == "cancelled"
    assert (await job(sql, "a"))["state"] == closed
    assert await schedule(sql, "a", revision=0) == "unchanged"  # same revision: a repeat
    assert (await job(sql, "a"))["state"] == closed
    assert await schedule(sql, "a", payload='{"v": 2}', revision=1) == "scheduled"
    row = await job(sql, "a")
    assert (row["state"], row["failures"], row["last_error"]) == ("scheduled", 0, None)
    assert row["attempt"] == 1  # never decreased
    last = (await events(sql, "a"))[-1]
    assert last[0] == "scheduled"
    assert last[2]["restarted_from"] == closed
    assert (await claim_one(ledger_, "a")).attempt == 2


# ---------------------------------------------------------------------------
# Bad input: SQLSTATE 22023, the message names the argument and the rule
# ---------------------------------------------------------------------------

_SCHEDULE = (
    "SELECT pacerd.schedule(job_id => $1, kind => $2, destination => $3, payload => $4::jsonb,"
    " max_attempts => $5, revision => $6)"
)
_REPORT = "SELECT pacerd.report(job_id => $1, attempt => $2, outcome => $3, retry_after_s => $4)"


@pytest.mark.parametrize(
    ("statement", "args", "expected"),
    [
        (_SCHEDULE, ("", "k", "d", "{}", None, 0), "job_id must not be empty"),
        (_SCHEDULE, ("  ", "k", "d", "{}", None, 0), "job_id must not be empty"),
        (_SCHEDULE, (None, "k", "d", "{}", None, 0), "job_id must not be empty"),
        (_SCHEDULE, ("x" * 513, "k", "d", "{}", None, 0), "job_id must be at most 512"),
        (_SCHEDULE, ("a", "", "d", "{}", None, 0), "kind must not be empty"),
        (_SCHEDULE, ("a", "k", "", "{}", None, 0), "destination must not be empty"),
        (_SCHEDULE, ("a", "k", None, "{}", None, 0), "destination must not be empty"),
        (_SCHEDULE, ("a", "k", "has space", "{}", None, 0), "destination 'has space' must match"),
        (_SCHEDULE, ("a", "k", "-lead", "{}", None, 0), "destination '-lead' must match"),
        (_SCHEDULE, ("a", "k", "d", None, None, 0), "payload must not be NULL"),
        (_SCHEDULE, ("a", "k", "d", "{}", 0, 0), "max_attempts must be at least 1"),
        (_SCHEDULE, ("a", "k", "d", "{}", None, -1), "revision must not be negative"),
        (_REPORT, ("", 1, "ok", None), "job_id must not be empty"),
        (_REPORT, ("a", 0, "ok", None), "attempt must be a positive integer"),
        (_REPORT, ("a", None, "ok", None), "attempt must be a positive integer"),
        (_REPORT, ("a", 1, "maybe", None), "outcome must be one of ok, refused, retry, fail"),
        (_REPORT, ("a", 1, None, None), "outcome must be one of"),
        (_REPORT, ("a", 1, "refused", -1.0), "retry_after_s must be a finite number >= 0"),
        (_REPORT, ("a", 1, "refused", math.nan), "retry_after_s must be a finite number"),
        (_REPORT, ("a", 1, "refused", math.inf), "retry_after_s must be a finite number"),
        (_REPORT, ("a", 1, "refused", -math.inf), "retry_after_s must be a finite number"),
        (_REPORT, ("a", 1, "refused", 1e20), "retry_after_s must be at most 31536000"),
        ("SELECT pacerd.cancel(job_id => $1, reason => $2)", ("", "x"), "job_id must not be empty"),
        ("SELECT pacerd.replay(job_id => $1, reason => $2)", ("", "x"), "job_id must not be empty"),
        (
            "SELECT pacerd.replay(job_id => $1, reason => $2)",
            ("a", None),
            "reason must not be empty",
        ),
        (
            "SELECT pacerd.replay(job_id => $1, reason => $2)",
            ("a", " "),
            "reason must not be empty",
        ),
        ("SELECT pacerd.pause(destination => $1)", ("no way",), "destination 'no way' must match"),
    ],
)
async def test_bad_input_is_rejected(
    sql: asyncpg.Connection, statement: str, args: tuple[object, ...], expected: str
) -> None:
    # A job exists so that the report/replay checks are not answered 'unknown'.
    await schedule(sql, "a", eligible_at=utcnow())
    message = await rejection(sql, statement, *args)
    function = statement.split("(")[0].removeprefix("SELECT ")
    assert message.startswith(f"{function}: "), message  # names the function
    assert expected in message
    assert (await job(sql, "a"))["state"] == "scheduled"  # nothing changed


async def test_an_absurd_retry_after_is_rejected_not_an_overflow(
    ledger_: ledger.Ledger, sql: asyncpg.Connection
) -> None:
    """A worker relays the upstream's Retry-After; a nonsense value must be a
    clear rejection (22023), not a timestamp overflow (22008) that fails the
    outcome consumer's whole batch."""
    c = await offered_job(ledger_, sql, "a")
    message = await rejection(sql, _REPORT, "a", c.attempt, "refused", 1e20)
    assert "retry_after_s must be at most 31536000" in message
    b = await offered_job(ledger_, sql, "b")
    results = await ledger_.apply_reports(
        [
            Report(job_id="a", attempt=c.attempt, outcome=Outcome.REFUSED, retry_after_s=1e20),
            Report(job_id="b", attempt=b.attempt, outcome=Outcome.OK),
        ]
    )
    assert results[0].startswith("rejected: ")
    assert results[1] == "applied"
    assert (await job(sql, "a"))["state"] == "offered"
    assert await report(sql, "a", c.attempt, "refused", retry_after_s=31536000.0) == "applied"


async def test_bad_input_changes_nothing(sql: asyncpg.Connection) -> None:
    await rejection(sql, _SCHEDULE, "a", "k", "bad dest", "{}", None, 0)
    assert await sql.fetchval("SELECT count(*) FROM pacerd.jobs") == 0
    assert await sql.fetchval("SELECT count(*) FROM pacerd.job_events") == 0
    assert await sql.fetchval("SELECT count(*) FROM pacerd.destinations") == 0


async def test_payload_limit_comes_from_the_settings(
    ledger_: ledger.Ledger, sql: asyncpg.Connection
) -> None:
    def payload(n: int) -> str:  # a JSON document of exactly n bytes
        return json.dumps({"p": "x" * (n - len('{"p": ""}'))})

    limit = 256 * 1024
    assert await schedule(sql, "at-limit", payload=payload(limit)) == "scheduled"
    message = await rejection(sql, _SCHEDULE, "over", "k", "d", payload(limit + 1), None, 0)
    assert f"payload is {limit + 1} bytes, over the limit of {limit} bytes" in message
    assert "payload_max_bytes" in message

    await ledger_.write_settings({"payload_max_bytes": 100})
    assert await schedule(sql, "small", payload=payload(100)) == "scheduled"
    message = await rejection(sql, _SCHEDULE, "big", "k", "d", payload(101), None, 0)
    assert "payload is 101 bytes, over the limit of 100 bytes" in message
    # The limit guards revisions too.
    message = await rejection(sql, _SCHEDULE, "small", "k", "d", payload(101), None, 1)
    assert "over the limit of 100 bytes" in message


async def test_max_attempts_default_comes_from_the_settings(
    ledger_: ledger.Ledger, sql: asyncpg.Connection
) -> None:
    await ledger_.write_settings({"max_attempts": 4})
    await schedule(sql, "a")
    assert (await job(sql, "a"))["max_attempts"] == 4


async def test_client_translates_rejections(client: Client) -> None:
    with pytest.raises(LedgerRejected, match="destination must not be empty"):
        await client.schedule("a", kind="k", destination="", payload={})
    with pytest.raises(LedgerRejected, match="outcome must be one of"):
        await client.report("a", 1, "perhaps")
    with pytest.raises(LedgerRejected, match="reason must not be empty"):
        await client.replay("a", "")


# ---------------------------------------------------------------------------
# pacerd.report: fencing
# ---------------------------------------------------------------------------


async def test_report_for_an_unknown_job(sql: asyncpg.Connection) -> None:
    assert await report(sql, "nope", 1, "ok") == "unknown"
    assert await sql.fetchval("SELECT count(*) FROM pacerd.job_events") == 0


@pytest.mark.parametrize("attempt", [2, 7])
async def test_report_for_a_non_current_attempt_is_stale(
    ledger_: ledger.Ledger, sql: asyncpg.Connection, attempt: int
) -> None:
    await offered_job(ledger_, sql, "a")
    before = await job(sql, "a")
    assert await report(sql, "a", attempt, "ok", detail={"tokens": 3}) == "stale"
    assert await job(sql, "a") == before  # nothing but the history
    name, at_attempt, detail = (await events(sql, "a"))[-1]
    assert (name, at_attempt) == ("stale_report", attempt)
    assert detail["current_attempt"] == 1
    assert detail["outcome"] == "ok"
    assert detail["detail"] == {"tokens": 3}
    d = await destination(sql, "d")
    assert (d["n_accepted"], d["n_refused"]) == (0, 0)  # stale reports are not counted


async def test_an_older_attempt_is_stale(ledger_: ledger.Ledger, sql: asyncpg.Connection) -> None:
    await schedule(sql, "a", eligible_at=utcnow() - secs(1))
    first = await claim_one(ledger_, "a")
    await ledger_.release_claims([first.ref], reason="nack")
    second = await claim_one(ledger_, "a")
    assert (first.attempt, second.attempt) == (1, 2)
    await offer(ledger_, [second])
    assert await report(sql, "a", first.attempt, "ok") == "stale"
    assert (await job(sql, "a"))["state"] == "offered"
    assert await report(sql, "a", second.attempt, "ok") == "applied"


async def test_report_for_a_job_not_in_flight_is_stale(
    ledger_: ledger.Ledger, sql: asyncpg.Connection
) -> None:
    await schedule(sql, "a", eligible_at=utcnow() - secs(1))
    c = await claim_one(ledger_, "a")
    await ledger_.release_claims([c.ref], reason="publish failed")
    row = await job(sql, "a")
    assert (row["state"], row["attempt"]) == ("scheduled", 1)
    assert await report(sql, "a", 1, "ok") == "stale"  # right attempt, wrong state
    assert (await job(sql, "a"))["state"] == "scheduled"
    assert (await events(sql, "a"))[-1][2]["state"] == "scheduled"
    # A completed job does not complete twice either.
    c = await claim_one(ledger_, "a")
    assert await report(sql, "a", c.attempt, "ok") == "applied"
    assert await report(sql, "a", c.attempt, "ok") == "stale"
    assert (await destination(sql, "d"))["n_accepted"] == 1


async def test_report_after_the_offer_lease_expired_is_stale(
    ledger_: ledger.Ledger, sql: asyncpg.Connection
) -> None:
    await schedule(sql, "a", eligible_at=utcnow() - dt.timedelta(hours=2))
    past = utcnow() - dt.timedelta(hours=1)
    c = await claim_one(ledger_, "a", now=past)
    await offer(ledger_, [c], now=past, offer_seconds=60)  # the offer lease ended long ago
    assert (await job(sql, "a"))["state"] == "offered"  # not reclaimed yet
    assert not await is_current(sql, "a", c.attempt)
    assert await report(sql, "a", c.attempt, "ok") == "stale"
    assert (await job(sql, "a"))["state"] == "offered"
    name, _, detail = (await events(sql, "a"))[-1]
    assert (name, detail["lease_expired"]) == ("stale_report", True)


# ---------------------------------------------------------------------------
# pacerd.report: outcomes
# ---------------------------------------------------------------------------


async def test_ok_completes(ledger_: ledger.Ledger, sql: asyncpg.Connection) -> None:
    c = await offered_job(ledger_, sql, "a")
    assert await report(sql, "a", c.attempt, "ok", detail={"tokens": 812, "prompt": "v3"}) == (
        "applied"
    )
    row = await job(sql, "a")
    assert (row["state"], row["lease_expires_at"], row["failures"]) == ("completed", None, 0)
    name, attempt, detail = (await events(sql, "a"))[-1]
    assert (name, attempt) == ("completed", 1)
    assert detail["detail"] == {"tokens": 812, "prompt": "v3"}  # kept in the history
    d = await destination(sql, "d")
    assert (d["n_accepted"], d["n_refused"]) == (1, 0)
    assert not await is_current(sql, "a", c.attempt)


@pytest.mark.parametrize("outcome", ["ok", "refused", "retry", "fail", "continue"])
async def test_a_report_applies_while_still_claimed(
    ledger_: ledger.Ledger, sql: asyncpg.Connection, outcome: str
) -> None:
    """The worker was faster than the publisher confirm."""
    await schedule(sql, "a", eligible_at=utcnow() - secs(1))
    c = await claim_one(ledger_, "a")
    assert (await job(sql, "a"))["state"] == "claimed"
    assert await report(sql, "a", c.attempt, outcome, cursor={"page": 2}) == "applied"
    expected = {
        "ok": "completed",
        "refused": "scheduled",
        "retry": "scheduled",
        "fail": "dead",
        "continue": "scheduled",
    }[outcome]
    assert (await job(sql, "a"))["state"] == expected
    # The late confirm does not resurrect the claim, nor does a release.
    assert await offer(ledger_, [c]) == []
    assert await ledger_.release_claims([c.ref], reason="late") == []
    assert (await job(sql, "a"))["state"] == expected


async def test_refused_keeps_its_place_in_line(
    ledger_: ledger.Ledger, sql: asyncpg.Connection
) -> None:
    at = utcnow() - dt.timedelta(minutes=5)
    await schedule(sql, "a", eligible_at=at)
    c = await claim_one(ledger_, "a")
    await offer(ledger_, [c])
    assert await report(sql, "a", c.attempt, "refused", detail={"status": 429}) == "applied"
    row = await job(sql, "a")
    assert (row["state"], row["next_attempt_at"]) == ("scheduled", at)
    assert (row["attempt"], row["failures"], row["lease_expires_at"]) == (1, 0, None)
    assert (await events(sql, "a"))[-1][0] == "refused"
    d = await destination(sql, "d")
    assert (d["n_refused"], d["n_accepted"], d["n_retry_after"]) == (1, 0, 0)
    assert d["cooldown_until"] is None
    # It is due again at once; the next claim is a new attempt, nothing spent.
    again = await claim_one(ledger_, "a")
    assert again.attempt == 2
    assert (await job(sql, "a"))["failures"] == 0


async def test_refused_with_retry_after(ledger_: ledger.Ledger, sql: asyncpg.Connection) -> None:
    c = await offered_job(ledger_, sql, "a")
    before = utcnow()
    assert await report(sql, "a", c.attempt, "refused", retry_after_s=120.0) == "applied"
    after = utcnow()
    row = await job(sql, "a")
    assert row["state"] == "scheduled"
    assert before + secs(120) - SLACK <= row["next_attempt_at"] <= after + secs(120) + SLACK
    assert row["failures"] == 0
    d = await destination(sql, "d")
    assert (d["n_refused"], d["n_retry_after"]) == (1, 1)
    assert before + secs(120) - SLACK <= d["cooldown_until"] <= after + secs(120) + SLACK
    # Not claimable before the Retry-After has passed.
    assert await claim(ledger_, now=before + secs(60)) == []
    assert [j.job_id for j in await claim(ledger_, now=after + secs(121))] == ["a"]


async def test_closed_destinations_say_how_long_each_cool_down_has_left(
    ledger_: ledger.Ledger, sql: asyncpg.Connection
) -> None:
    """Cooling down: the seconds left (by the statement's clock, or the time
    given); paused, also while cooling down: None (closed until resumed);
    every destination paused: "*"."""
    c = await offered_job(ledger_, sql, "a")
    assert await report(sql, "a", c.attempt, "refused", retry_after_s=120.0) == "applied"
    await sql.execute("SELECT pacerd.pause('p')")
    closed = await ledger_.closed_destinations()
    assert closed.keys() == {"d", "p"}
    assert closed["p"] is None
    assert 120.0 - 1.0 < (closed["d"] or 0.0) <= 120.0
    later = await ledger_.closed_destinations(utcnow() + secs(100))
    assert 20.0 - 1.0 < (later["d"] or 0.0) <= 20.0
    assert await ledger_.closed_destinations(utcnow() + secs(121)) == {"p": None}
    await sql.execute("SELECT pacerd.pause('d')")
    assert await ledger_.closed_destinations() == {"d": None, "p": None}
    await sql.execute("SELECT pacerd.pause(NULL)")
    assert await ledger_.closed_destinations() == {"d": None, "p": None, "*": None}


async def test_retry_after_never_moves_a_job_earlier_nor_shortens_a_cooldown(
    ledger_: ledger.Ledger, sql: asyncpg.Connection
) -> None:
    a = await offered_job(ledger_, sql, "a")
    b = await offered_job(ledger_, sql, "b")
    await report(sql, "a", a.attempt, "refused", retry_after_s=600.0)
    cooldown = (await destination(sql, "d"))["cooldown_until"]
    await report(sql, "b", b.attempt, "refused", retry_after_s=5.0)
    assert (await destination(sql, "d"))["cooldown_until"] == cooldown


async def test_retry_spends_an_attempt_with_capped_exponential_backoff(
    ledger_: ledger.Ledger, sql: asyncpg.Connection
) -> None:
    base, cap = 10.0, 25.0
    await ledger_.write_settings({"backoff_base_seconds": base, "backoff_cap_seconds": cap})
    await schedule(sql, "a", eligible_at=utcnow() - secs(1), max_attempts=4)
    later = utcnow() + dt.timedelta(hours=1)  # claims happen after any backoff
    for n in (1, 2, 3):
        c = await claim_one(ledger_, "a", now=later)
        await offer(ledger_, [c], now=later)
        before = utcnow()
        assert await report(sql, "a", c.attempt, "retry", error=f"timeout {n}") == "applied"
        after = utcnow()
        row = await job(sql, "a")
        assert (row["state"], row["failures"], row["attempt"]) == ("scheduled", n, n)
        assert row["last_error"] == f"timeout {n}"
        bound = secs(min(cap, base * 2 ** (n - 1)))
        assert before - SLACK <= row["next_attempt_at"] <= after + bound + SLACK
        name, _, detail = (await events(sql, "a"))[-1]
        assert (name, detail["failures"]) == ("rescheduled", n)
    c = await claim_one(ledger_, "a", now=later)
    await offer(ledger_, [c], now=later)
    assert await report(sql, "a", c.attempt, "retry", error="timeout 4") == "applied"
    row = await job(sql, "a")
    assert (row["state"], row["failures"], row["last_error"]) == ("dead", 4, "timeout 4")
    name, _, detail = (await events(sql, "a"))[-1]
    assert (name, detail["reason"]) == ("dead", "attempts_exhausted")
    assert await claim(ledger_, now=later + dt.timedelta(days=365)) == []  # never claimed again
    assert (await destination(sql, "d"))["n_accepted"] == 4  # a retry is not a refusal


async def test_retry_backoff_is_jittered(ledger_: ledger.Ledger, sql: asyncpg.Connection) -> None:
    await ledger_.write_settings({"backoff_base_seconds": 100.0, "backoff_cap_seconds": 1000.0})
    await sql.execute(
        "SELECT pacerd.schedule(job_id => 'j' || g, kind => 'k', destination => 'd',"
        " payload => '{}', eligible_at => now() - interval '1 minute')"
        " FROM generate_series(1, 40) g"
    )
    jobs = await claim(ledger_, limit=100)
    await offer(ledger_, jobs)
    async with sql.transaction():  # one transaction: one now()
        reported_at = await sql.fetchval("SELECT now()")
        for j in jobs:
            assert await report(sql, j.job_id, j.attempt, "retry") == "applied"
    delays = [
        (r["next_attempt_at"] - reported_at).total_seconds()
        for r in await sql.fetch("SELECT next_attempt_at FROM pacerd.jobs")
    ]
    assert len(delays) == 40
    assert all(0 <= d <= 100 for d in delays)  # full jitter: uniform in [0, base]
    assert min(delays) < 50 < max(delays)


async def test_fail_is_dead_at_once(ledger_: ledger.Ledger, sql: asyncpg.Connection) -> None:
    c = await offered_job(ledger_, sql, "a", max_attempts=5)
    assert await report(sql, "a", c.attempt, "fail", error="invalid address") == "applied"
    row = await job(sql, "a")
    assert (row["state"], row["last_error"], row["failures"]) == ("dead", "invalid address", 0)
    assert row["lease_expires_at"] is None
    name, _, detail = (await events(sql, "a"))[-1]
    assert (name, detail["reason"], detail["error"]) == ("dead", "failed", "invalid address")
    assert (await destination(sql, "d"))["n_accepted"] == 1


async def test_continue_checkpoints_and_is_due_at_once(
    ledger_: ledger.Ledger, sql: asyncpg.Connection
) -> None:
    at = utcnow() - dt.timedelta(minutes=3)
    await schedule(sql, "a", eligible_at=at)
    c = await claim_one(ledger_, "a")
    await offer(ledger_, [c])
    assert await report(sql, "a", c.attempt, "continue", cursor={"page": 7}) == "applied"
    row = await job(sql, "a")
    assert (row["state"], row["cursor"], row["failures"]) == ("scheduled", {"page": 7}, 0)
    assert row["next_attempt_at"] == at  # eligible at once, in its place
    name, _, detail = (await events(sql, "a"))[-1]
    assert (name, detail["cursor"]) == ("continued", {"page": 7})
    again = await claim_one(ledger_, "a")
    assert again.attempt == 2
    assert json.loads(again.cursor_json or "null") == {"page": 7}  # the worker resumes from it
    await offer(ledger_, [again])
    assert await report(sql, "a", again.attempt, "ok") == "applied"
    assert (await job(sql, "a"))["cursor"] == {"page": 7}


async def test_continue_of_a_future_job_makes_it_due_now(
    ledger_: ledger.Ledger, sql: asyncpg.Connection
) -> None:
    future = utcnow() + dt.timedelta(days=1)
    await schedule(sql, "a", eligible_at=future)
    c = await claim_one(ledger_, "a", now=future)
    before = utcnow()
    assert await report(sql, "a", c.attempt, "continue", cursor=[1]) == "applied"
    after = utcnow()
    assert before - SLACK <= (await job(sql, "a"))["next_attempt_at"] <= after + SLACK


# ---------------------------------------------------------------------------
# pacerd.cancel, pacerd.replay, pacerd.is_current
# ---------------------------------------------------------------------------


async def test_cancel(sql: asyncpg.Connection) -> None:
    await schedule(sql, "a")
    assert await cancel(sql, "a", "no longer needed") == "cancelled"
    assert (await job(sql, "a"))["state"] == "cancelled"
    name, _, detail = (await events(sql, "a"))[-1]
    assert (name, detail["reason"], detail["previous_state"]) == (
        "cancelled",
        "no longer needed",
        "scheduled",
    )
    assert await cancel(sql, "a") == "unchanged"
    assert await cancel(sql, "nope") == "unknown"
    assert await event_names(sql, "a") == ["scheduled", "cancelled"]


async def test_cancel_makes_an_in_flight_offer_stale(
    ledger_: ledger.Ledger, sql: asyncpg.Connection
) -> None:
    c = await offered_job(ledger_, sql, "a")
    assert await cancel(sql, "a") == "cancelled"
    row = await job(sql, "a")
    assert (row["state"], row["lease_expires_at"]) == ("cancelled", None)
    assert not await is_current(sql, "a", c.attempt)
    assert await report(sql, "a", c.attempt, "ok") == "stale"
    assert await ledger_.reclaim_expired(limit=10, now=utcnow() + dt.timedelta(days=1)) == []
    assert (await job(sql, "a"))["state"] == "cancelled"


async def test_cancel_of_a_closed_job_is_unchanged(
    ledger_: ledger.Ledger, sql: asyncpg.Connection
) -> None:
    c = await offered_job(ledger_, sql, "a")
    await report(sql, "a", c.attempt, "ok")
    assert await cancel(sql, "a") == "unchanged"
    assert (await job(sql, "a"))["state"] == "completed"


async def test_replay_only_from_dead(ledger_: ledger.Ledger, sql: asyncpg.Connection) -> None:
    await schedule(sql, "a", eligible_at=utcnow() - secs(1), max_attempts=2)
    assert await replay(sql, "a") == "unchanged"  # scheduled
    assert await replay(sql, "nope") == "unknown"
    for _ in range(2):
        c = await claim_one(ledger_, "a", now=utcnow() + dt.timedelta(hours=1))
        await offer(ledger_, [c])
        await report(sql, "a", c.attempt, "retry", error="flaky")
    row = await job(sql, "a")
    assert (row["state"], row["failures"], row["attempt"]) == ("dead", 2, 2)
    before = utcnow()
    assert await replay(sql, "a", "upstream fixed in INC-42") == "replayed"
    after = utcnow()
    row = await job(sql, "a")
    assert (row["state"], row["failures"], row["attempt"]) == ("scheduled", 0, 2)
    assert before - SLACK <= row["next_attempt_at"] <= after + SLACK  # eligible now
    name, _, detail = (await events(sql, "a"))[-1]
    assert (name, detail["reason"], detail["failures_before"]) == (
        "replayed",
        "upstream fixed in INC-42",
        2,
    )
    assert await replay(sql, "a") == "unchanged"  # not dead any more
    again = await claim_one(ledger_, "a")
    assert again.attempt == 3
    assert not again.live  # a replay is backlog
    # A replayed job has its full allowance of attempts again.
    await offer(ledger_, [again])
    await report(sql, "a", again.attempt, "retry")
    assert (await job(sql, "a"))["state"] == "scheduled"


async def test_replay_of_completed_and_cancelled_is_unchanged(
    ledger_: ledger.Ledger, sql: asyncpg.Connection
) -> None:
    c = await offered_job(ledger_, sql, "a")
    await report(sql, "a", c.attempt, "ok")
    await schedule(sql, "b")
    await cancel(sql, "b")
    assert await replay(sql, "a") == "unchanged"
    assert await replay(sql, "b") == "unchanged"


async def test_is_current(ledger_: ledger.Ledger, sql: asyncpg.Connection) -> None:
    assert not await is_current(sql, "nope", 1)
    await schedule(sql, "a", eligible_at=utcnow() - secs(1))
    assert not await is_current(sql, "a", 1)  # scheduled: nobody holds it
    c = await claim_one(ledger_, "a")
    assert await is_current(sql, "a", c.attempt)  # claimed
    assert not await is_current(sql, "a", c.attempt + 1)
    await offer(ledger_, [c])
    assert await is_current(sql, "a", c.attempt)  # offered
    assert not await is_current(sql, "a", c.attempt - 1)
    await report(sql, "a", c.attempt, "ok")
    assert not await is_current(sql, "a", c.attempt)  # already completed


# ---------------------------------------------------------------------------
# pacerd.pause / pacerd.resume
# ---------------------------------------------------------------------------


async def test_pause_and_resume_one_destination(
    ledger_: ledger.Ledger, sql: asyncpg.Connection
) -> None:
    pause = "SELECT pacerd.pause(destination => $1)"
    resume = "SELECT pacerd.resume(destination => $1)"
    assert await sql.fetchval(pause, "later") == "paused"  # not known yet: registered, paused
    assert await sql.fetchval(pause, "later") == "unchanged"
    d = await destination(sql, "later")
    assert d["paused"] is True
    assert d["paused_at"] is not None
    row = await ledger_.read_destination("later")
    assert row is not None
    assert row.effectively_paused
    assert not row.paused_all
    await schedule(sql, "a", destination="later")
    assert (await destination(sql, "later"))["paused"] is True  # scheduling does not unpause
    other = await ledger_.read_destination("d")
    assert other is None or not other.effectively_paused
    assert await sql.fetchval(resume, "later") == "resumed"
    assert await sql.fetchval(resume, "later") == "unchanged"
    assert await sql.fetchval(resume, "never-seen") == "unchanged"
    d = await destination(sql, "later")
    assert d["paused"] is False
    assert d["paused_at"] is None


async def test_pause_all(ledger_: ledger.Ledger, sql: asyncpg.Connection) -> None:
    await schedule(sql, "a", destination="one")
    assert await sql.fetchval("SELECT pacerd.pause()") == "paused"
    assert await sql.fetchval("SELECT pacerd.pause(destination => NULL)") == "unchanged"
    control = await sql.fetchrow("SELECT paused_all, paused_at FROM pacerd.control")
    assert control is not None
    assert control["paused_all"]
    assert control["paused_at"] is not None
    await schedule(sql, "b", destination="two")  # a future destination is paused too
    for name in ("one", "two"):
        row = await ledger_.read_destination(name)
        assert row is not None
        assert row.paused_all
        assert row.effectively_paused
    # resume(one) lifts only its own pause: the pause of all still applies.
    await sql.fetchval("SELECT pacerd.pause('one')")
    assert await sql.fetchval("SELECT pacerd.resume('one')") == "resumed"
    row = await ledger_.read_destination("one")
    assert row is not None
    assert not row.paused
    assert row.effectively_paused
    # resume(NULL) lifts every pause.
    await sql.fetchval("SELECT pacerd.pause('two')")
    assert await sql.fetchval("SELECT pacerd.resume()") == "resumed"
    assert await sql.fetchval("SELECT pacerd.resume()") == "unchanged"
    for row in await ledger_.list_destinations():
        assert not row.effectively_paused


# ---------------------------------------------------------------------------
# History and the attempt counter
# ---------------------------------------------------------------------------


async def test_every_transition_writes_history(
    ledger_: ledger.Ledger, sql: asyncpg.Connection
) -> None:
    at = utcnow() - secs(10)
    await schedule(sql, "a", eligible_at=at)
    c1 = await claim_one(ledger_, "a")
    await ledger_.release_claims([c1.ref], reason="publish failed")
    c2 = await claim_one(ledger_, "a")
    await offer(ledger_, [c2])
    await report(sql, "a", c2.attempt, "refused")
    c3 = await claim_one(ledger_, "a")
    await offer(ledger_, [c3])
    await report(sql, "a", c3.attempt, "continue", cursor={"n": 1})
    await schedule(sql, "a", revision=1, eligible_at=at)
    c4 = await claim_one(ledger_, "a")
    await offer(ledger_, [c4])
    await report(sql, "a", c4.attempt, "fail", error="bad")
    await replay(sql, "a", "retry it")
    c5 = await claim_one(ledger_, "a")
    await offer(ledger_, [c5])
    await report(sql, "a", c5.attempt, "ok")
    await report(sql, "a", c5.attempt, "ok")  # a duplicate delivery: stale
    await cancel(sql, "a")  # closed: unchanged, no row
    assert [(e, a) for e, a, _ in await events(sql, "a")] == [
        ("scheduled", 0),
        ("claimed", 1),
        ("released", 1),
        ("claimed", 2),
        ("offered", 2),
        ("refused", 2),
        ("claimed", 3),
        ("offered", 3),
        ("continued", 3),
        ("revised", 3),
        ("claimed", 4),
        ("offered", 4),
        ("dead", 4),
        ("replayed", 4),
        ("claimed", 5),
        ("offered", 5),
        ("completed", 5),
        ("stale_report", 5),
    ]
    assert (await events(sql, "a"))[2][2] == {"reason": "publish failed"}
    # message ids a:1 .. a:5 were each used once
    assert [c.attempt for c in (c1, c2, c3, c4, c5)] == [1, 2, 3, 4, 5]


async def test_client_drives_the_sql_api(
    ledger_: ledger.Ledger, client: Client, sql: asyncpg.Connection
) -> None:
    eligible = utcnow() - secs(1)
    assert (
        await client.schedule(
            "a", kind="k", destination="d", payload={"x": [1, 2]}, eligible_at=eligible
        )
        == "scheduled"
    )
    assert await client.schedule("a", kind="k", destination="d", payload={}) == "unchanged"
    c = await claim_one(ledger_, "a")
    await offer(ledger_, [c])
    assert await client.is_current("a", c.attempt)
    assert await client.report("a", c.attempt + 1, Outcome.OK) == "stale"
    assert await client.report("a", c.attempt, Outcome.FAIL, error="nope", detail={"k": 1}) == (
        "applied"
    )
    assert await client.replay("a", "try again") == "replayed"
    assert await client.cancel("a", "enough") == "cancelled"
    assert await client.cancel("missing") == "unknown"
    assert await client.pause("d") == "paused"
    assert await client.resume() == "resumed"
    shown = await client.show("a")
    assert shown is not None
    view, history = shown
    assert (view.state, view.payload, view.attempt) == (JobState.CANCELLED, {"x": [1, 2]}, 1)
    assert [e.event for e in history] == await event_names(sql, "a")
    assert history[-1].detail == {"reason": "enough", "previous_state": "scheduled"}


# ---------------------------------------------------------------------------
# The daemon's statements: claim_due
# ---------------------------------------------------------------------------


async def test_claim_due_oldest_first(ledger_: ledger.Ledger, sql: asyncpg.Connection) -> None:
    t = utcnow()
    ages = {"a": 50, "b": 10, "c": 40, "d": 30, "e": 20}  # seconds overdue
    for job_id, age in ages.items():
        await schedule(
            sql, job_id, kind="kk", payload=f'{{"n": "{job_id}"}}', eligible_at=t - secs(age)
        )
    got = await claim(ledger_, limit=3, now=t, live_window_seconds=0)
    assert [j.job_id for j in got] == ["a", "c", "d"]
    first = got[0]
    assert (first.kind, first.destination, first.attempt, first.revision) == ("kk", "d", 1, 0)
    assert json.loads(first.payload_json) == {"n": "a"}
    assert first.cursor_json is None
    assert first.eligible_at == t - secs(50)
    row = await job(sql, "a")
    assert (row["state"], row["lease_expires_at"], row["claimed_by"]) == (
        "claimed",
        t + secs(30),
        INSTANCE,
    )
    assert [j.job_id for j in await claim(ledger_, limit=3, now=t)] == ["e", "b"]
    assert await claim(ledger_, limit=3, now=t) == []


async def test_claim_due_never_takes_a_future_or_closed_or_in_flight_job(
    ledger_: ledger.Ledger, sql: asyncpg.Connection
) -> None:
    t = utcnow()
    await schedule(sql, "future", eligible_at=t + secs(1))
    await schedule(sql, "other-destination", destination="e", eligible_at=t - secs(5))
    for name in ("completed", "dead", "cancelled", "offered", "claimed"):
        await schedule(sql, name, eligible_at=t - secs(5))
        c = await claim_one(ledger_, name, now=t)
        if name != "claimed":
            await offer(ledger_, [c], now=t)
        if name == "completed":
            await report(sql, name, c.attempt, "ok")
        elif name == "dead":
            await report(sql, name, c.attempt, "fail")
        elif name == "cancelled":
            await cancel(sql, name)
    await schedule(sql, "due", eligible_at=t)  # due exactly now
    assert [j.job_id for j in await claim(ledger_, limit=100, now=t)] == ["due"]
    assert [j.job_id for j in await claim(ledger_, limit=100, now=t + secs(1))] == ["future"]
    assert await claim(ledger_, limit=100, now=t + dt.timedelta(days=9999)) == []
    assert [j.job_id for j in await claim(ledger_, "e", limit=100, now=t)] == ["other-destination"]


async def test_claim_due_limit_zero_claims_nothing(
    ledger_: ledger.Ledger, sql: asyncpg.Connection
) -> None:
    await schedule(sql, "a", eligible_at=utcnow() - secs(1))
    assert await claim(ledger_, limit=0) == []
    assert await claim(ledger_, limit=1, live_limit=5) != []


async def _lanes_fixture(led: ledger.Ledger, conn: asyncpg.Connection, t: dt.datetime) -> None:
    """Backlog b1 < b2 < b3 (first attempts, overdue beyond the 600 s window) and
    r1 (offered once, due inside the window); live l1 < l2 < l3."""
    await schedule(conn, "r1", eligible_at=t - secs(250))
    c = await claim_one(led, "r1", now=t - secs(250))
    await offer(led, [c], now=t)
    assert await report(conn, "r1", c.attempt, "refused") == "applied"  # keeps t - 250 s
    for job_id, age in (("b1", 3 * 3600), ("b2", 2 * 3600), ("b3", 3600)):
        await schedule(conn, job_id, eligible_at=t - secs(age))
    for job_id, age in (("l1", 300), ("l2", 200), ("l3", 100)):
        await schedule(conn, job_id, eligible_at=t - secs(age))


@pytest.mark.parametrize(
    ("limit", "live_limit", "live", "backlog"),
    [
        # Both lanes have plenty: the reservation holds, each lane oldest first.
        (4, 2, ["l1", "l2"], ["b1", "b2"]),
        # No reservation: backlog (older) first, live only fills what is left.
        (2, 0, [], ["b1", "b2"]),
        (6, 0, ["l1", "l2"], ["b1", "b2", "b3", "r1"]),
        # All reserved for live.
        (2, 2, ["l1", "l2"], []),
        # Unused live share flows to the backlog (3 live jobs, 5 reserved).
        (6, 5, ["l1", "l2", "l3"], ["b1", "b2", "b3"]),
        # Unused backlog share flows to the live lane (4 backlog jobs, 6 of 7 theirs).
        (7, 1, ["l1", "l2", "l3"], ["b1", "b2", "b3", "r1"]),
        (100, 0, ["l1", "l2", "l3"], ["b1", "b2", "b3", "r1"]),
    ],
)
async def test_claim_due_lanes(
    ledger_: ledger.Ledger,
    sql: asyncpg.Connection,
    limit: int,
    live_limit: int,
    live: list[str],
    backlog: list[str],
) -> None:
    t = utcnow()
    await _lanes_fixture(ledger_, sql, t)
    got = await claim(ledger_, limit=limit, live_limit=live_limit, live_window_seconds=600, now=t)
    assert sorted(j.job_id for j in got if j.live) == live
    assert sorted(j.job_id for j in got if not j.live) == backlog
    # returned oldest first, whatever the lane
    assert [j.eligible_at for j in got] == sorted(j.eligible_at for j in got)
    for j in got:
        lane = (await events(sql, j.job_id))[-1][2]["lane"]
        assert lane == ("live" if j.live else "backlog")


async def test_a_report_before_the_confirm_makes_the_job_backlog(
    ledger_: ledger.Ledger, sql: asyncpg.Connection
) -> None:
    """A retry is backlog even when the worker reported before the confirm."""
    await ledger_.write_settings({"backoff_base_seconds": 0.001, "backoff_cap_seconds": 0.001})
    await schedule(sql, "a", eligible_at=utcnow() - secs(1))
    c = await claim_one(ledger_, "a")
    assert c.live  # a first attempt, due within the live window
    assert await report(sql, "a", c.attempt, "retry") == "applied"  # still 'claimed'
    again = await claim(ledger_, limit=1, live_limit=1, now=utcnow() + secs(1))
    assert [(j.job_id, j.live) for j in again] == [("a", False)]


async def test_a_reclaimed_claim_is_backlog(
    ledger_: ledger.Ledger, sql: asyncpg.Connection
) -> None:
    """docs/protocol.md, Terms: reclaimed leases are backlog."""
    t = utcnow()
    await schedule(sql, "a", eligible_at=t - secs(5))
    c = await claim(ledger_, limit=1, live_limit=1, now=t)
    assert [j.live for j in c] == [True]
    await ledger_.reclaim_expired(limit=10, now=t + secs(31))
    again = await claim(ledger_, limit=1, live_limit=1, now=t + secs(32))
    assert [(j.job_id, j.live) for j in again] == [("a", False)]


async def test_released_claims_keep_their_attempt(
    ledger_: ledger.Ledger, sql: asyncpg.Connection
) -> None:
    t = utcnow()
    await schedule(sql, "a", eligible_at=t - secs(5))
    await schedule(sql, "b", eligible_at=t - secs(4))
    got = await claim(ledger_, now=t)
    a, b = got
    # fenced by attempt and by state
    assert await ledger_.release_claims([JobRef(job_id="a", attempt=2)], reason="x") == []
    await offer(ledger_, [b], now=t)
    assert await ledger_.release_claims([a.ref, b.ref], reason="broker nack") == [a.ref]
    row = await job(sql, "a")
    assert (row["state"], row["attempt"], row["lease_expires_at"], row["claimed_by"]) == (
        "scheduled",
        1,
        None,
        None,
    )
    assert row["next_attempt_at"] == t - secs(5)  # its place in line
    assert row["failures"] == 0  # a failed publish spends nothing
    assert (await events(sql, "a"))[-1] == ("released", 1, {"reason": "broker nack"})
    assert (await job(sql, "b"))["state"] == "offered"
    assert [j.attempt for j in await claim(ledger_, now=t)] == [2]  # a:2, never a:1 again


async def test_mark_offered_is_fenced(ledger_: ledger.Ledger, sql: asyncpg.Connection) -> None:
    t = utcnow()
    await schedule(sql, "a", eligible_at=t - secs(5))
    await schedule(sql, "b", eligible_at=t - secs(4))
    a, b = await claim(ledger_, now=t)
    wrong = JobRef(job_id="b", attempt=b.attempt + 1)
    assert await ledger_.mark_offered(
        [a.ref, wrong, JobRef(job_id="nope", attempt=1)], offer_seconds=90, now=t + secs(1)
    ) == [a.ref]
    row = await job(sql, "a")
    assert (row["state"], row["ever_offered"]) == ("offered", True)
    assert row["lease_expires_at"] == t + secs(91)
    assert (await job(sql, "b"))["state"] == "claimed"
    assert await offer(ledger_, [a]) == []  # a second confirm changes nothing
    assert await event_names(sql, "a") == ["scheduled", "claimed", "offered"]


# ---------------------------------------------------------------------------
# reclaim_expired
# ---------------------------------------------------------------------------


async def test_reclaim_expired(ledger_: ledger.Ledger, sql: asyncpg.Connection) -> None:
    t = utcnow()
    await schedule(sql, "claim", eligible_at=t - secs(10))
    await schedule(sql, "offer", eligible_at=t - secs(9))
    await schedule(sql, "last", eligible_at=t - secs(8), max_attempts=1)
    await schedule(sql, "young", eligible_at=t - secs(7))
    _c, o, last = await claim(ledger_, limit=3, now=t)  # claim lease: t + 30 s
    await offer(ledger_, [o, last], now=t, offer_seconds=60)  # offer lease: t + 60 s
    (y,) = await claim(ledger_, now=t + secs(100))  # claim lease: t + 130 s

    assert await ledger_.reclaim_expired(limit=100, now=t + secs(10)) == []
    got = await ledger_.reclaim_expired(limit=100, now=t + secs(45))
    assert [(r.job_id, r.previous_state, r.state, r.attempt) for r in got] == [
        ("claim", JobState.CLAIMED, JobState.SCHEDULED, 1)
    ]
    row = await job(sql, "claim")
    assert (row["state"], row["failures"], row["attempt"], row["lease_expires_at"]) == (
        "scheduled",
        0,
        1,
        None,
    )
    name, _, detail = (await events(sql, "claim"))[-1]
    assert (name, detail["lease"]) == ("lease_expired", "claim")

    got = await ledger_.reclaim_expired(limit=100, now=t + secs(90))
    assert sorted((r.job_id, r.previous_state, r.state) for r in got) == [
        ("last", JobState.OFFERED, JobState.DEAD),
        ("offer", JobState.OFFERED, JobState.SCHEDULED),
    ]
    row = await job(sql, "offer")
    assert (row["state"], row["failures"], row["attempt"]) == ("scheduled", 1, 1)
    assert row["last_error"] == "offer lease expired without an outcome"
    assert row["next_attempt_at"] == t - secs(9)
    name, _, detail = (await events(sql, "offer"))[-1]
    assert (name, detail["lease"], detail["failures"]) == ("lease_expired", "offer", 1)
    row = await job(sql, "last")
    assert (row["state"], row["failures"]) == ("dead", 1)
    name, _, detail = (await events(sql, "last"))[-1]
    assert (name, detail["reason"]) == ("dead", "attempts_exhausted")
    assert (await job(sql, "young"))["state"] == "claimed"  # its lease runs until t + 130 s
    # A late report for the reclaimed offer is stale.
    assert await report(sql, "offer", o.attempt, "ok") == "stale"
    # The reclaimed jobs come back with a new attempt.
    again = await claim(ledger_, now=t + secs(90))
    assert sorted((j.job_id, j.attempt) for j in again) == [("claim", 2), ("offer", 2)]
    assert y.attempt == 1


async def test_reclaim_expired_oldest_lease_first_and_bounded(
    ledger_: ledger.Ledger, sql: asyncpg.Connection
) -> None:
    t = utcnow()
    for i in range(5):
        await schedule(sql, f"j{i}", eligible_at=t - secs(10))
        await claim(ledger_, now=t + secs(i))  # lease t + i + 30 s
    got = await ledger_.reclaim_expired(limit=2, now=t + secs(100))
    assert [r.job_id for r in got] == ["j0", "j1"]
    got = await ledger_.reclaim_expired(limit=10, now=t + secs(100))
    assert sorted(r.job_id for r in got) == ["j2", "j3", "j4"]


# ---------------------------------------------------------------------------
# apply_reports, outcome counters and the epoch
# ---------------------------------------------------------------------------


async def test_apply_reports_batch(ledger_: ledger.Ledger, sql: asyncpg.Connection) -> None:
    t = utcnow() - secs(1)
    for name in ("a", "b", "c", "d"):
        await schedule(sql, name, eligible_at=t)
    jobs = {j.job_id: j for j in await claim(ledger_)}
    await offer(ledger_, list(jobs.values()))
    results = await ledger_.apply_reports(
        [
            Report(job_id="a", attempt=1, outcome=Outcome.OK, detail={"tokens": 5}),
            Report(job_id="b", attempt=1, outcome=Outcome.CONTINUE, cursor={"at": 3}),
            Report(job_id="nope", attempt=1, outcome=Outcome.OK),
            Report(job_id="c", attempt=9, outcome=Outcome.OK),
            Report(job_id="d", attempt=1, outcome=Outcome.REFUSED, retry_after_s=30.0),
        ]
    )
    assert results == ["applied", "applied", "unknown", "stale", "applied"]
    assert (await job(sql, "a"))["state"] == "completed"
    assert (await job(sql, "b"))["cursor"] == {"at": 3}
    assert (await job(sql, "c"))["state"] == "offered"
    assert (await job(sql, "d"))["state"] == "scheduled"
    assert (await events(sql, "a"))[-1][2]["detail"] == {"tokens": 5}
    assert await ledger_.apply_reports([]) == []


async def test_apply_reports_a_rejected_report_does_not_undo_the_others(
    ledger_: ledger.Ledger, sql: asyncpg.Connection
) -> None:
    t = utcnow() - secs(1)
    for name in ("a", "b", "c"):
        await schedule(sql, name, eligible_at=t)
    await offer(ledger_, await claim(ledger_))
    results = await ledger_.apply_reports(
        [
            Report(job_id="a", attempt=1, outcome=Outcome.OK),
            Report(job_id="b", attempt=1, outcome=Outcome.REFUSED, retry_after_s=-5.0),
            Report(job_id="c", attempt=1, outcome=Outcome.FAIL, error="bad"),
        ]
    )
    assert results[0] == "applied"
    assert results[1].startswith("rejected: ")
    assert "retry_after_s" in results[1]
    assert results[2] == "applied"
    assert (await job(sql, "a"))["state"] == "completed"
    assert (await job(sql, "b"))["state"] == "offered"  # unchanged, its lease will expire
    assert (await job(sql, "c"))["state"] == "dead"
    assert await event_names(sql, "a") == ["scheduled", "claimed", "offered", "completed"]
    assert (await destination(sql, "d"))["n_accepted"] == 2  # counted once each


async def _report_batch_fixture(
    led: ledger.Ledger, conn: asyncpg.Connection, dest: str, t: dt.datetime
) -> list[Report]:
    """The same jobs and reports on destination ``dest`` (job ids prefixed by it)."""
    past = t - dt.timedelta(hours=1)

    async def take(suffix: str, *, epoch: int = 0, confirm_at: dt.datetime | None = t) -> None:
        await schedule(conn, f"{dest}-{suffix}", destination=dest, eligible_at=t - secs(5))
        (c,) = await claim(led, dest, limit=1, now=t, epoch=epoch)
        assert c.job_id == f"{dest}-{suffix}"
        if confirm_at is not None:
            assert await offer(led, [c], now=confirm_at) == [c.ref]

    for suffix in ("ok", "stale", "twice", "dup", "refused", "fail", "old-epoch"):
        await take(suffix)
    await take("expired", confirm_at=past)  # its offer lease ended an hour ago
    await take("claimed", confirm_at=None)  # the worker beat the confirm
    await led.save_pacer_state(dest, {"rate": 1.0}, epoch=1)  # the pacer cut
    await take("new-epoch", epoch=1)

    def r(suffix: str, outcome: Outcome, attempt: int = 1, **kw: Any) -> Report:
        return Report(job_id=f"{dest}-{suffix}", attempt=attempt, outcome=outcome, **kw)

    return [
        r("ok", Outcome.OK, detail={"tokens": 9}, cursor={"done": True}),
        r("stale", Outcome.OK, attempt=2),
        r("expired", Outcome.OK),
        r("twice", Outcome.CONTINUE, cursor={"page": 3}),
        r("twice", Outcome.OK),
        r("claimed", Outcome.OK, error="ignored"),
        r("refused", Outcome.REFUSED, retry_after_s=10.0, detail={"status": 429}),
        r("missing", Outcome.OK),
        r("dup", Outcome.OK),
        r("dup", Outcome.OK),
        r("fail", Outcome.FAIL, error="bad request"),
        r("old-epoch", Outcome.OK),
        r("new-epoch", Outcome.OK),
    ]


async def test_apply_reports_equals_pacerd_report_one_by_one(
    ledger_: ledger.Ledger, sql: asyncpg.Connection
) -> None:
    """A batch through apply_reports has exactly the results and effects of
    pacerd.report called on each report, in order, in one transaction."""
    t = utcnow()
    batch = await _report_batch_fixture(ledger_, sql, "batch", t)
    single = await _report_batch_fixture(ledger_, sql, "single", t)
    mark = await sql.fetchval("SELECT max(id) FROM pacerd.job_events")
    got_batch = await ledger_.apply_reports(batch)
    got_single = []
    async with sql.transaction():
        for rep in single:
            got_single.append(
                await report(
                    sql,
                    rep.job_id,
                    rep.attempt,
                    str(rep.outcome),
                    retry_after_s=rep.retry_after_s,
                    error=rep.error,
                    detail=rep.detail,
                    cursor=rep.cursor,
                )
            )
    assert got_batch == got_single
    assert got_batch == [
        "applied",
        "stale",
        "stale",
        "applied",
        "stale",
        "applied",
        "applied",
        "unknown",
        "applied",
        "stale",
        "applied",
        "applied",
        "applied",
    ]

    async def effects(dest: str) -> tuple[object, ...]:
        rows = await sql.fetch(
            "SELECT substr(job_id, length($1) + 2) AS suffix, state, attempt, failures, cursor,"
            " last_error, lease_expires_at IS NULL AS no_lease, ever_offered,"
            " CASE WHEN job_id LIKE '%-refused' THEN NULL ELSE next_attempt_at END AS next_at"
            " FROM pacerd.jobs WHERE destination = $1 ORDER BY 1",
            dest,
        )
        history = await sql.fetch(
            "SELECT substr(job_id, length($1) + 2) AS suffix, attempt, event,"
            " detail FROM pacerd.job_events WHERE job_id LIKE $1 || '-%' AND id > $2"
            " ORDER BY job_id, id",  # each job's history in order (not across jobs)
            dest,
            mark,
        )
        counters = await sql.fetchrow(
            "SELECT n_accepted, n_refused, n_accepted_fresh, n_refused_fresh, n_retry_after,"
            " cooldown_until IS NOT NULL AS cooling FROM pacerd.destinations"
            " WHERE destination = $1",
            dest,
        )
        jobs_ = [tuple(r) for r in rows]
        return jobs_, [tuple(r) for r in history], tuple(counters or ())

    batch_effects, single_effects = await effects("batch"), await effects("single")
    assert batch_effects == single_effects
    assert batch_effects[2] == (7, 1, 1, 0, 1, True)  # only new-epoch counts as fresh


async def test_outcome_counters_and_epoch(ledger_: ledger.Ledger, sql: asyncpg.Connection) -> None:
    t = utcnow() - secs(10)
    for i in range(4):
        await schedule(sql, f"j{i}", eligible_at=t + secs(i))
    old = await claim(ledger_, limit=2, epoch=0)  # j0, j1 admitted in epoch 0
    await offer(ledger_, old)
    await ledger_.save_pacer_state("d", {"rate": 1.0}, epoch=1)  # the pacer cut: epoch 1
    new = await claim(ledger_, limit=2, epoch=1)  # j2, j3 admitted after the cut
    await offer(ledger_, new)
    assert await report(sql, "j0", 1, "refused") == "applied"
    assert await report(sql, "j1", 1, "ok") == "applied"
    assert await report(sql, "j2", 1, "refused", retry_after_s=1.0) == "applied"
    assert await report(sql, "j3", 1, "retry") == "applied"
    d = await destination(sql, "d")
    assert (d["n_accepted"], d["n_refused"], d["n_retry_after"]) == (2, 2, 1)
    assert (d["n_accepted_fresh"], d["n_refused_fresh"]) == (1, 1)  # only j2, j3
    row = await ledger_.read_destination("d")
    assert row is not None
    assert (row.n_accepted, row.n_refused, row.n_accepted_fresh, row.n_refused_fresh) == (
        2,
        2,
        1,
        1,
    )
    assert row.epoch == 1
    await ledger_.save_pacer_state("d", {"rate": 2.0}, epoch=0)  # the epoch never goes back
    row = await ledger_.read_destination("d")
    assert row is not None
    assert row.epoch == 1


async def test_pacer_state_round_trips_as_an_object(
    ledger_: ledger.Ledger, sql: asyncpg.Connection
) -> None:
    await ledger_.ensure_destination("d")
    await ledger_.save_pacer_state("d", {"pacer": {"rate": 5.0}, "tick": {"budget": 3}}, epoch=0)
    assert await sql.fetchval("SELECT jsonb_typeof(pacer_state) FROM pacerd.destinations") == (
        "object"
    )
    row = await ledger_.read_destination("d")
    assert row is not None
    assert row.pacer_state == {"pacer": {"rate": 5.0}, "tick": {"budget": 3}}


async def test_settings_are_stored_as_json_values(
    ledger_: ledger.Ledger, sql: asyncpg.Connection
) -> None:
    await ledger_.write_settings({"payload_max_bytes": 1234, "backoff_base_seconds": 0.25})
    rows = {
        r["key"]: r["t"]
        for r in await sql.fetch("SELECT key, jsonb_typeof(value) AS t FROM pacerd.settings")
    }
    assert rows["payload_max_bytes"] == "number"
    assert rows["backoff_base_seconds"] == "number"
    assert await sql.fetchval("SELECT pacerd._setting('payload_max_bytes')::bigint") == 1234


# ---------------------------------------------------------------------------
# Small reads
# ---------------------------------------------------------------------------


async def test_oldest_due_has_due_and_the_inflight_count_read_with_the_row(
    ledger_: ledger.Ledger, sql: asyncpg.Connection
) -> None:
    t = utcnow()
    assert await ledger_.oldest_due("d", now=t) is None
    assert await ledger_.has_due("d", now=t) == 0
    for i in range(5):
        await schedule(sql, f"j{i}", eligible_at=t - secs(10 - i))
    await schedule(sql, "future", eligible_at=t + secs(60))
    assert await ledger_.oldest_due("d", now=t) == t - secs(10)
    assert await ledger_.has_due("d", at_least=3, now=t) == 3
    assert await ledger_.has_due("d", at_least=100, now=t) == 5
    got = await claim(ledger_, limit=2, now=t)
    await offer(ledger_, got[:1], now=t)
    row = await ledger_.read_destination("d", inflight=True)
    assert row is not None
    assert row.inflight == 2
    row = await ledger_.read_destination("d")
    assert row is not None
    assert row.inflight is None
    assert await ledger_.oldest_due("d", now=t) == t - secs(8)
    summary = {s.destination: s for s in await ledger_.due_summary(now=t)}
    assert (summary["d"].due, summary["d"].inflight, summary["d"].dead) == (3, 2, 0)


async def test_has_due_many_counts_each_destination_up_to_its_bound_in_the_order_asked(
    ledger_: ledger.Ledger, sql: asyncpg.Connection
) -> None:
    t = utcnow()
    assert await ledger_.has_due_many([], now=t) == []
    for i in range(5):
        await schedule(sql, f"d{i}", eligible_at=t - secs(10 - i))
        due_at = t - secs(1) if i == 0 else t + secs(i)  # one due, four later
        await schedule(sql, f"e{i}", destination="e", eligible_at=due_at)
    await schedule(sql, "future", eligible_at=t + secs(60))
    asks = [("e", 100), ("d", 3), ("unknown", 5), ("d", 100), ("e", 1)]
    assert await ledger_.has_due_many(asks, now=t) == [1, 3, 0, 5, 1]
    assert [await ledger_.has_due(name, at_least=n, now=t) for name, n in asks] == [1, 3, 0, 5, 1]


async def test_the_daemons_pool_sends_no_reset_but_rolls_back_an_open_transaction(
    db_dsn: str, sql: asyncpg.Connection
) -> None:
    """A statement is one round trip: the pool's default reset on release
    (pg_advisory_unlock_all, CLOSE ALL, UNLISTEN, RESET ALL) was a second one,
    and a transaction of its own, after each. What asyncpg rolls back itself,
    a transaction left open, still is; the session settings stay (JIT off)."""
    led = await ledger.Ledger.connect(db_dsn, max_size=1)
    try:
        pid = await led.pool.fetchval("SELECT pg_backend_pid()")
        await led.closed_destinations()
        last = await sql.fetchval("SELECT query FROM pg_stat_activity WHERE pid = $1", pid)
        assert last == led.queries["closed_destinations"].sql
        async with led.pool.acquire() as conn:
            await conn.execute("BEGIN")
            await conn.execute("UPDATE pacerd.control SET paused_all = true")
        async with led.pool.acquire() as conn:
            assert await conn.fetchval("SELECT pg_backend_pid()") == pid  # the same session
            assert not await conn.fetchval("SELECT paused_all FROM pacerd.control")
            assert await conn.fetchval("SHOW jit") == "off"
    finally:
        await led.close()
