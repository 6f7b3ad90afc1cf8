"""Least privilege in the ledger: each role runs its functions and writes no
table; the definer functions cannot be steered through the caller's
search_path; creating the roles is idempotent across the databases of one
cluster; ``--print-grants`` and ``--no-roles`` (real PostgreSQL)."""

from __future__ import annotations

import uuid

import anyio
import asyncpg
import pytest
from role_helpers import admin, login_role, unique_role
from support.cli import run_pacerd
from support.services import ADMIN_DSN, dsn_for, with_user

from pacerd import ledger
from pacerd.roles import RoleNames

pytestmark = [pytest.mark.services, pytest.mark.timeout(120)]

ROLES = RoleNames()

# One call of every function, each harmless on an empty ledger.
CALLS = {
    "schedule": "SELECT pacerd.schedule('role-job', 'k', 'role-dest', '{}')",
    "cancel": "SELECT pacerd.cancel('no-such-job', 'why')",
    "is_current": "SELECT pacerd.is_current('no-such-job', 1)",
    "report": "SELECT pacerd.report('no-such-job', 1, 'ok')",
    "replay": "SELECT pacerd.replay('no-such-job', 'why')",
    "pause": "SELECT pacerd.pause('role-dest')",
    "resume": "SELECT pacerd.resume('role-dest')",
    "report_many": "SELECT pacerd.report_many(ARRAY['no-such-job'], ARRAY[1], ARRAY['ok'],"
    " ARRAY[NULL]::float8[], ARRAY[NULL], ARRAY[NULL]::jsonb[], ARRAY[NULL]::jsonb[])",
    "_setting": "SELECT pacerd._setting('max_attempts')",
    "_event": "SELECT pacerd._event('no-such-job', 1, 'forged', NULL)",
}
ALLOWED = {
    ROLES.producer: {"schedule", "cancel", "is_current"},
    ROLES.worker: {"report", "is_current"},
    ROLES.operator: {"schedule", "cancel", "is_current", "replay", "pause", "resume"},
}
# Every table, with one of its columns.
TABLES = {
    "jobs": "job_id",
    "job_events": "event",
    "destinations": "destination",
    "control": "paused_all",
    "settings": "key",
    "migrations": "name",
}
# Every role reads the applied migrations: the CLI tells an unmigrated ledger apart.
READABLE = {
    ROLES.producer: {"migrations"},
    ROLES.worker: {"migrations"},
    ROLES.operator: {"jobs", "job_events", "destinations", "control", "migrations"},
}
WRITES = (
    "UPDATE pacerd.{t} SET {c} = {c}",
    "DELETE FROM pacerd.{t}",
    "TRUNCATE pacerd.{t}",
)


@pytest.mark.parametrize("role", [ROLES.producer, ROLES.worker, ROLES.operator])
async def test_a_role_runs_its_functions_and_writes_no_table(db_dsn: str, role: str) -> None:
    async with login_role(role) as user:
        conn = await asyncpg.connect(with_user(db_dsn, user))
        try:
            for name, sql in CALLS.items():
                if name in ALLOWED[role]:
                    await conn.fetchval(sql)
                else:
                    with pytest.raises(asyncpg.InsufficientPrivilegeError, match="function"):
                        await conn.fetchval(sql)
            for table, column in TABLES.items():
                for write in WRITES:
                    with pytest.raises(asyncpg.InsufficientPrivilegeError, match=table):
                        await conn.execute(write.format(t=table, c=column))
                with pytest.raises(asyncpg.InsufficientPrivilegeError):
                    await conn.execute(f"INSERT INTO pacerd.{table} DEFAULT VALUES")
                if table in READABLE.get(role, set()):
                    await conn.fetch(f"SELECT * FROM pacerd.{table} LIMIT 1")
                else:
                    with pytest.raises(asyncpg.InsufficientPrivilegeError, match=table):
                        await conn.fetch(f"SELECT * FROM pacerd.{table} LIMIT 1")
            with pytest.raises(asyncpg.InsufficientPrivilegeError, match="schema pacerd"):
                await conn.execute("CREATE TABLE pacerd.mine (a int)")
        finally:
            await conn.close()
    # What the producer and operator scheduled was written with the owner's rights.
    if "schedule" in ALLOWED[role]:
        owner = await asyncpg.connect(db_dsn)
        try:
            events = await owner.fetch(
                "SELECT event FROM pacerd.job_events WHERE job_id = 'role-job'"
            )
        finally:
            await owner.close()
        assert [e["event"] for e in events] == ["scheduled"]


async def test_the_worker_reports_its_offer_and_the_producer_cannot(
    ledger_: ledger.Ledger, db_dsn: str
) -> None:
    await ledger_.pool.fetchval("SELECT pacerd.schedule('w-1', 'k', 'role-w', '{}')")
    [claimed] = await ledger_.claim_due(
        "role-w", live_limit=0, limit=1, claim_seconds=60, epoch=0,
        live_window_seconds=0, instance="test",
    )  # fmt: skip
    async with login_role(ROLES.producer) as producer, login_role(ROLES.worker) as worker:
        as_producer = await asyncpg.connect(with_user(db_dsn, producer))
        as_worker = await asyncpg.connect(with_user(db_dsn, worker))
        try:
            with pytest.raises(asyncpg.InsufficientPrivilegeError):
                await as_producer.fetchval("SELECT pacerd.report('w-1', $1, 'ok')", claimed.attempt)
            assert await as_worker.fetchval("SELECT pacerd.is_current('w-1', $1)", claimed.attempt)
            result = await as_worker.fetchval(
                "SELECT pacerd.report('w-1', $1, 'ok')", claimed.attempt
            )
            assert result == "applied"
        finally:
            await as_producer.close()
            await as_worker.close()
    assert await ledger_.pool.fetchval("SELECT state FROM pacerd.jobs WHERE job_id = 'w-1'") == (
        "completed"
    )


# A caller's traps: a now() and a text = text of its own, earlier in its path
# than pg_catalog. Each records who ran it (inside a definer function, that
# would be the owner).
TRAPS = """
CREATE TABLE evil.calls (who text NOT NULL, what text NOT NULL);
CREATE FUNCTION evil.now() RETURNS timestamptz LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO evil.calls VALUES (current_user, 'now');
    RETURN '2000-01-01T00:00:00Z'::timestamptz;
END $$;
CREATE FUNCTION evil.texteq(a text, b text) RETURNS boolean LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO evil.calls VALUES (current_user, '=');
    RETURN length(b) > 0;  -- every non-empty text is equal to every text
END $$;
CREATE OPERATOR evil.= (LEFTARG = text, RIGHTARG = text, FUNCTION = evil.texteq);
"""


async def test_search_path_tricks_do_not_reach_the_definer_functions(db_dsn: str) -> None:
    async with login_role(ROLES.producer) as user:
        owner = await asyncpg.connect(db_dsn)
        try:
            await owner.execute(f"CREATE SCHEMA evil AUTHORIZATION {user}")
            await owner.execute("SELECT pacerd.schedule('victim', 'k', 'sp-dest', '{}')")
            conn = await asyncpg.connect(with_user(db_dsn, user))
            try:
                await conn.execute(TRAPS)
                await conn.execute("SET search_path = evil, pg_catalog, pacerd")
                # The traps are armed: the caller's own statements reach them.
                assert await conn.fetchval("SELECT 'a'::text = 'b'::text") is True
                assert (await conn.fetchval("SELECT now()")).year == 2000
                await conn.execute("TRUNCATE evil.calls")

                scheduled = await conn.fetchval(
                    "SELECT pacerd.schedule('sp-1', 'k', 'sp-dest', '{}', eligible_at => NULL)"
                )
                assert scheduled == "scheduled"
                assert await conn.fetchval("SELECT pacerd.cancel('no-such-job', 'x')") == "unknown"
                assert await conn.fetchval("SELECT pacerd.is_current('victim', 1)") is False
                assert await conn.fetch("SELECT who, what FROM evil.calls") == []
            finally:
                await conn.close()
            row = await owner.fetchrow(
                "SELECT next_attempt_at, created_at FROM pacerd.jobs WHERE job_id = 'sp-1'"
            )
            assert row is not None
            assert row["next_attempt_at"] == row["created_at"]  # the real now(), not 2000
            victim = await owner.fetchval("SELECT state FROM pacerd.jobs WHERE job_id = 'victim'")
            assert victim == "scheduled"

            # The same function without its fixed path runs the caller's
            # operator as the owner: what the setting prevents.
            await owner.execute("ALTER FUNCTION pacerd.cancel RESET search_path")
            conn = await asyncpg.connect(with_user(db_dsn, user))
            try:
                await conn.execute("SET search_path = evil, pg_catalog, pacerd")
                # It finds a job that does not exist (its `=` is the caller's now).
                assert await conn.fetchval("SELECT pacerd.cancel('no-such-job', 'x')") != (
                    "unknown"
                )
                calls = await conn.fetch("SELECT DISTINCT who, what FROM evil.calls")
            finally:
                await conn.close()
            owner_name = await owner.fetchval("SELECT current_user")
            assert [(c["who"], c["what"]) for c in calls] == [(owner_name, "=")]
        finally:
            await owner.execute("DROP SCHEMA IF EXISTS evil CASCADE")
            await owner.close()


async def _database(name: str) -> str:
    await admin(f'CREATE DATABASE "{name}"')
    return dsn_for(name)


async def test_roles_created_meanwhile_by_other_migrates_are_not_an_error() -> None:
    """Two databases of one cluster migrated at once, while a third session
    creates one of the roles and has not committed yet."""
    names = RoleNames(producer=unique_role(), worker=unique_role(), operator=unique_role())
    databases = [f"pacerd_e_{uuid.uuid4().hex[:12]}" for _ in range(2)]
    blocker = await asyncpg.connect(ADMIN_DSN)
    watcher = await asyncpg.connect(ADMIN_DSN)
    try:
        dsns = [await _database(d) for d in databases]
        transaction = blocker.transaction()
        await transaction.start()
        await blocker.execute(f"CREATE ROLE {names.producer} NOLOGIN")
        results: list[list[str]] = []

        async def run(dsn: str) -> None:
            results.append(await ledger.migrate(dsn, roles=names))

        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                for dsn in dsns:
                    tg.start_soon(run, dsn)
                # Both wait on the uncommitted role before it is committed.
                # (a transaction sees one snapshot of pg_stat_activity: ask outside it)
                while await watcher.fetchval(
                    "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                    " AND wait_event = 'transactionid' AND datname = ANY($1::text[])",
                    databases,
                ) < len(dsns):
                    await anyio.sleep(0.05)
                await transaction.commit()
        assert len(results) == 2
        assert all("0004_roles.sql" in r for r in results)
        for dsn in dsns:
            conn = await asyncpg.connect(dsn)
            try:
                for role, allowed in (
                    (names.producer, "pacerd.schedule"),
                    (names.worker, "pacerd.report"),
                    (names.operator, "pacerd.replay"),
                ):
                    assert await conn.fetchval(
                        "SELECT has_function_privilege($1, $2::regproc, 'EXECUTE')", role, allowed
                    )
            finally:
                await conn.close()
    finally:
        await blocker.close()
        await watcher.close()
        for d in databases:
            await admin(f'DROP DATABASE IF EXISTS "{d}" WITH (FORCE)')
        for role in (names.producer, names.worker, names.operator):
            await admin(f"DROP ROLE IF EXISTS {role}")


async def test_print_grants_shows_the_sql_and_changes_nothing(empty_db_dsn: str) -> None:
    producer = unique_role()
    done = run_pacerd(empty_db_dsn, "migrate", "--print-grants", "--producer-role", producer)
    assert done.returncode == 0, done.stderr
    assert f"CREATE ROLE {producer} NOLOGIN" in done.stdout
    functions = "pacerd.schedule, pacerd.cancel, pacerd.is_current"
    assert f"GRANT EXECUTE ON FUNCTION {functions} TO {producer};" in done.stdout
    assert "SECURITY DEFINER SET search_path = pg_catalog, pacerd, pg_temp" in done.stdout
    conn = await asyncpg.connect(empty_db_dsn)
    try:
        assert await conn.fetchval("SELECT to_regnamespace('pacerd')") is None
        assert not await conn.fetchval("SELECT count(*) FROM pg_roles WHERE rolname = $1", producer)
    finally:
        await conn.close()
    bad = run_pacerd(empty_db_dsn, "migrate", "--print-grants", "--worker-role", "x; DROP TABLE y")
    assert bad.returncode == 2
    assert "role name 'x; DROP TABLE y'" in bad.stderr


async def test_no_roles_creates_none_and_grants_those_that_exist(empty_db_dsn: str) -> None:
    missing = unique_role()
    async with login_role() as existing:
        done = run_pacerd(
            empty_db_dsn, "migrate", "--no-roles",
            "--producer-role", existing, "--worker-role", missing,
        )  # fmt: skip
        conn = await asyncpg.connect(empty_db_dsn)
        try:
            assert done.returncode == 0, done.stderr
            assert f"role {missing} does not exist: its grants were skipped" in done.stderr
            assert not await conn.fetchval(
                "SELECT count(*) FROM pg_roles WHERE rolname = $1", missing
            )
            assert await conn.fetchval(
                "SELECT has_function_privilege($1, 'pacerd.cancel(text,text)', 'EXECUTE')",
                existing,
            )
            assert not await conn.fetchval(
                "SELECT has_table_privilege($1, 'pacerd.jobs', 'SELECT')", existing
            )
        finally:
            await conn.execute(f"DROP OWNED BY {existing}")  # its grants, before the role goes
            await conn.close()


async def test_cli_verbs_on_each_role(db_dsn: str) -> None:
    """The producer schedules through the CLI but cannot read status; the
    operator reads status, shows a job and pauses."""
    async with login_role(ROLES.producer) as producer, login_role(ROLES.operator) as operator:
        as_producer, as_operator = with_user(db_dsn, producer), with_user(db_dsn, operator)
        done = run_pacerd(as_producer, "schedule", "cli-1", "--kind", "k", "--destination", "cli-d")
        assert (done.returncode, done.stdout.strip()) == (0, "cli-1: scheduled"), done.stderr
        denied = run_pacerd(as_producer, "status")
        assert denied.returncode == 1
        assert "permission denied" in denied.stderr
        assert "Traceback" not in denied.stderr
        for args in (
            ("status",),
            ("show", "cli-1"),
            ("dead",),
            ("pause", "--destination", "cli-d"),
        ):
            done = run_pacerd(as_operator, *args)
            assert done.returncode == 0, (args, done.stderr)
        assert "cli-d" in run_pacerd(as_operator, "status").stdout
    conn = await asyncpg.connect(db_dsn)
    try:
        paused = await conn.fetchval(
            "SELECT paused FROM pacerd.destinations WHERE destination = 'cli-d'"
        )
    finally:
        await conn.close()
    assert paused is True
