"""The cost of a tick must not grow with the backlog (docs/protocol.md, "The tick").

The claim, the oldest-due lookup, the bounded due count, the in-flight count
and the reclaim of expired leases are planned and run (EXPLAIN ANALYZE, in a
transaction that is rolled back) on one ledger holding 10k and then 200k rows
of due backlog, and on one holding only future work. The plans must be range
scans on the partial indexes (never a sequential scan of ``pacerd.jobs``), and
the rows and buffers one batch of 500 touches must stay flat while the backlog
grows twentyfold.

Run with ``-s`` to see the figures.
"""

from __future__ import annotations

import datetime as dt
import json
import uuid
from typing import TYPE_CHECKING, Any

import asyncpg
import pytest
from support.services import ADMIN_DSN, dsn_for

from pacerd import ledger

if TYPE_CHECKING:
    from collections.abc import Iterator

# one worker builds the ledgers once for the whole module
pytestmark = [pytest.mark.services, pytest.mark.xdist_group("claim_plan")]

SMALL, LARGE = 10_000, 200_000
BATCH = 500
LIVE_ROWS = 1_000  # due within the live window, at both sizes
INFLIGHT_ROWS = 2_000  # offered, their leases expired, at both sizes
NOW = dt.datetime(2030, 1, 1, tzinfo=dt.UTC)

# statement -> (arguments, the indexes its scans of pacerd.jobs may use)
STATEMENTS: dict[str, tuple[tuple[object, ...], set[str]]] = {
    # per destination: name, live_limit, limit, claim_seconds, epoch, live_window_seconds;
    # then now, instance
    "claim_due": (
        (["d"], [100], [BATCH], [30.0], [1], [60.0], NOW, "plan"),
        {"jobs_due_idx", "jobs_pkey"},
    ),
    "oldest_due": (("d", NOW), {"jobs_due_idx"}),
    "has_due_many": ((["d"], [BATCH], NOW), {"jobs_due_idx"}),
    "read_destination": ((["d"], NOW, True), {"jobs_inflight_idx"}),
    "reclaim_expired": ((NOW, BATCH), {"jobs_lease_idx", "jobs_pkey"}),
}
# Scans that find the work: what they touch must not depend on the backlog.
RANGE_SCANS = {"jobs_due_idx", "jobs_lease_idx", "jobs_inflight_idx"}
MAX_TOUCHED = BATCH + LIVE_ROWS + INFLIGHT_ROWS


def statements() -> list[Any]:
    return list(STATEMENTS)


def shapes() -> list[Any]:
    return [
        pytest.param(size, name, id=f"{size}-{name}")
        for size in ("10k", "200k", "idle")
        for name in STATEMENTS
    ]


# ---------------------------------------------------------------------------
# Building the ledgers
# ---------------------------------------------------------------------------


async def admin(sql: str) -> None:
    conn = await asyncpg.connect(ADMIN_DSN)
    try:
        await conn.execute(sql)
    finally:
        await conn.close()


async def add_backlog(conn: asyncpg.Connection, first: int, count: int, *, days: int = -30) -> None:
    """First attempts, one a second from ``NOW + days``, 90 % of them for d."""
    await conn.execute(
        "INSERT INTO pacerd.jobs (job_id, kind, destination, max_attempts, next_attempt_at,"
        " revision, payload)"
        " SELECT 'backlog-' || g, 'k', CASE WHEN g % 10 = 0 THEN 'e' ELSE 'd' END, 10,"
        "        $1::timestamptz + make_interval(days => $4) + g * interval '1 second', 0,"
        "        jsonb_build_object('n', g)"
        " FROM generate_series($2::int, $3::int) g",
        NOW,
        first,
        first + count - 1,
        days,
    )


async def add_fixed_rows(conn: asyncpg.Connection) -> None:
    """What does not grow with the backlog: live work and expired offers (and
    the destinations' rows, which a tick's read joins its in-flight count to)."""
    await conn.execute("INSERT INTO pacerd.destinations (destination) VALUES ('d'), ('e')")
    await conn.execute(
        "INSERT INTO pacerd.jobs (job_id, kind, destination, max_attempts, next_attempt_at,"
        " payload)"
        " SELECT 'live-' || g, 'k', 'd', 10, $1::timestamptz - g * interval '10 ms', '{}'"
        " FROM generate_series(1, $2::int) g",
        NOW,
        LIVE_ROWS,
    )
    await conn.execute(
        "INSERT INTO pacerd.jobs (job_id, kind, destination, state, attempt, max_attempts,"
        " next_attempt_at, payload, lease_expires_at, ever_offered)"
        " SELECT 'inflight-' || g, 'k', 'd', 'offered', 1, 10,"
        "        $1::timestamptz - interval '1 hour', '{}',"
        "        $1::timestamptz - interval '10 minutes' + g * interval '1 ms', true"
        " FROM generate_series(1, $2::int) g",
        NOW,
        INFLIGHT_ROWS,
    )


# ---------------------------------------------------------------------------
# Reading plans
# ---------------------------------------------------------------------------


def nodes(plan: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield plan
    for child in plan.get("Plans", []):
        yield from nodes(child)


def buffers(node: dict[str, Any]) -> int:
    return int(node.get("Shared Hit Blocks", 0)) + int(node.get("Shared Read Blocks", 0))


def total_buffers(plan: dict[str, Any]) -> int:
    """Blocks the whole statement touched: the top node (inclusive of what it
    pulled, the UPDATE of a claim included) plus the history INSERT, a CTE
    that nothing reads and that runs on its own at the end."""
    total = buffers(plan)
    for child in plan.get("Plans", []):
        if child.get("Parent Relationship") == "InitPlan" and child.get("Operation") == "Insert":
            total += buffers(child)
    return total


def touched(node: dict[str, Any]) -> int:
    rows = node.get("Actual Rows", 0) * node.get("Actual Loops", 1)
    return int(
        rows + node.get("Rows Removed by Filter", 0) + node.get("Rows Removed by Join Filter", 0)
    )


def scanned(plan: dict[str, Any]) -> int:
    """The most rows one range scan of the work touched."""
    return max((touched(n) for n in nodes(plan) if n.get("Index Name") in RANGE_SCANS), default=0)


async def explain(conn: ledger.Conn, name: str, *, top: bool = False) -> dict[str, Any]:
    """The plan of statement ``name`` as it ran (``top``: EXPLAIN's whole
    document, with its JIT section, rather than the plan tree)."""
    args, _ = STATEMENTS[name]
    sql = ledger.load_queries()[name].sql
    tx = conn.transaction()
    await tx.start()
    try:
        raw = await conn.fetchval(f"EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) {sql}", *args)
    finally:
        await tx.rollback()  # the claim and the reclaim change nothing
    doc = json.loads(raw) if isinstance(raw, str) else raw
    plan: dict[str, Any] = doc[0] if top else doc[0]["Plan"]
    return plan


async def measure(conn: asyncpg.Connection) -> dict[str, dict[str, Any]]:
    await conn.execute("VACUUM (ANALYZE) pacerd.jobs")
    for name in STATEMENTS:  # warm the caches, then measure on a clean table
        await explain(conn, name)
    await conn.execute("VACUUM (ANALYZE) pacerd.jobs")
    return {name: await explain(conn, name) for name in STATEMENTS}


@pytest.fixture(scope="module")
async def plans(template_db: str) -> dict[str, dict[str, dict[str, Any]]]:
    """size -> statement -> plan: "10k" and "200k" rows of due backlog, and
    "idle" (50k rows, all of them in the future)."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for scenario in ("growing", "idle"):
        name = f"pacerd_plan_{uuid.uuid4().hex[:12]}"
        await admin(f'CREATE DATABASE "{name}" TEMPLATE "{template_db}"')
        try:
            conn = await asyncpg.connect(dsn_for(name))
            try:
                await add_fixed_rows(conn)
                if scenario == "growing":
                    await add_backlog(conn, 1, SMALL)
                    out["10k"] = await measure(conn)
                    await add_backlog(conn, SMALL + 1, LARGE - SMALL)
                    out["200k"] = await measure(conn)
                else:
                    await conn.execute("DELETE FROM pacerd.jobs WHERE job_id LIKE 'live-%'")
                    await add_backlog(conn, 1, 50_000, days=30)
                    out["idle"] = await measure(conn)
            finally:
                await conn.close()
        finally:
            await admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    print()
    for statement in STATEMENTS:
        figures = [
            f"{size} {total_buffers(p[statement])} buffers / {scanned(p[statement])} rows scanned"
            for size, p in out.items()
        ]
        print(f"{statement:16s} " + ", ".join(figures))
    return out


# ---------------------------------------------------------------------------
# The tests
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(("size", "statement"), shapes())
def test_plan_is_a_bounded_range_scan_on_the_partial_indexes(
    plans: dict[str, dict[str, dict[str, Any]]], size: str, statement: str
) -> None:
    plan = plans[size][statement]
    _, allowed = STATEMENTS[statement]
    scans = [
        n
        for n in nodes(plan)
        if n.get("Relation Name") == "jobs" or n["Node Type"] == "Bitmap Index Scan"
    ]
    assert scans, "no scan of pacerd.jobs?"
    for scan in scans:
        where = f"{scan['Node Type']} {scan.get('Index Name', '')}"
        assert scan["Node Type"] != "Seq Scan", where
        if "Index Name" in scan:
            assert scan["Index Name"] in allowed, where
        if scan.get("Index Name") in RANGE_SCANS or scan["Node Type"] == "Bitmap Heap Scan":
            # the scan reads what it returns (and what the other lane takes), never
            # the backlog it skips
            assert touched(scan) <= MAX_TOUCHED, (where, touched(scan))


@pytest.mark.parametrize("statement", statements())
def test_batch_cost_does_not_grow_with_the_backlog(
    plans: dict[str, dict[str, dict[str, Any]]], statement: str
) -> None:
    small, large = plans["10k"][statement], plans["200k"][statement]
    assert small["Actual Rows"] == large["Actual Rows"]  # the same work at both sizes
    b_small, b_large = total_buffers(small), total_buffers(large)
    assert b_large <= 1.5 * b_small + 50, (b_small, b_large)


@pytest.mark.parametrize("statement", ["oldest_due", "has_due_many", "claim_due"])
def test_nothing_due_costs_next_to_nothing(
    plans: dict[str, dict[str, dict[str, Any]]], statement: str
) -> None:
    """An idle destination with a large future schedule: a tick that finds
    nothing due does not read the schedule."""
    plan = plans["idle"][statement]
    assert total_buffers(plan) <= 50, total_buffers(plan)


async def test_claim_due_takes_the_live_share_and_the_oldest_backlog(db_dsn: str) -> None:
    """What the measured claim takes: the 500 it should."""
    conn = await asyncpg.connect(db_dsn)
    try:
        await add_fixed_rows(conn)
        await add_backlog(conn, 1, SMALL)
        await conn.execute("ANALYZE pacerd.jobs")
        args, _ = STATEMENTS["claim_due"]
        tx = conn.transaction()
        await tx.start()
        try:
            rows = await conn.fetch(ledger.load_queries()["claim_due"].sql, *args)
        finally:
            await tx.rollback()
    finally:
        await conn.close()
    assert len(rows) == BATCH
    live = [r["job_id"] for r in rows if r["live"]]
    backlog = [r["job_id"] for r in rows if not r["live"]]
    assert sorted(live) == sorted(f"live-{g}" for g in range(901, 1001))  # the 100 oldest live
    oldest = [f"backlog-{g}" for g in range(1, 451) if g % 10]  # destination d only
    assert backlog == oldest[: BATCH - 100]


async def test_has_due_survives_stale_statistics(db_dsn: str) -> None:
    conn = await asyncpg.connect(db_dsn)
    try:
        await conn.execute("ALTER TABLE pacerd.jobs SET (autovacuum_enabled = false)")
        await add_backlog(conn, 1, 30_000)
        await conn.execute("VACUUM (ANALYZE) pacerd.jobs")
        # A drain: nearly all of it done since the last ANALYZE.
        await conn.execute("UPDATE pacerd.jobs SET state = 'completed' WHERE job_id <> 'backlog-1'")
        args, _ = STATEMENTS["has_due_many"]
        raw = await conn.fetchval(
            f"EXPLAIN (FORMAT JSON) {ledger.load_queries()['has_due_many'].sql}", *args
        )
    finally:
        await conn.close()
    plan = (json.loads(raw) if isinstance(raw, str) else raw)[0]["Plan"]
    assert [n["Node Type"] for n in nodes(plan) if n.get("Relation Name") == "jobs"] != ["Seq Scan"]


async def test_pacerds_connections_never_jit_compile_the_claim(db_dsn: str) -> None:
    """The claim's estimated cost (arrays unnested, CTEs) is over PostgreSQL's
    ``jit_above_cost``: on a connection with the server's defaults it is
    compiled on every call (~0.6 s of CPU for a statement that runs in
    ~0.2 ms, and a tick's releases bunched behind it). pacerd's own pool
    turns JIT off."""
    conn = await asyncpg.connect(db_dsn)
    try:
        await add_fixed_rows(conn)
        await add_backlog(conn, 1, SMALL)
        await conn.execute("ANALYZE pacerd.jobs")
        server_jits = await conn.fetchval("SHOW jit") == "on"
        by_default = await explain(conn, "claim_due", top=True)
    finally:
        await conn.close()
    led = await ledger.Ledger.connect(db_dsn, max_size=1)
    try:
        async with led.pool.acquire() as pooled:
            ours = await explain(pooled, "claim_due", top=True)
    finally:
        await led.close()
    if server_jits:  # the control: what the setting prevents
        assert "JIT" in by_default
    assert "JIT" not in ours


async def test_a_claim_for_many_destinations_reads_each_lane_once(db_dsn: str) -> None:
    """One claim statement serves every destination of a tick: its cost must
    grow with the destinations, not with their square. Each lane (the live
    and the backlog jobs it found) is read once, whatever the number of
    destinations; a count per destination over a whole lane made a claim of
    1,000 destinations spend ~140 ms in two million comparisons."""
    n, per = 300, 3
    names = [f"many-{i:04d}" for i in range(n)]
    conn = await asyncpg.connect(db_dsn)
    try:
        await conn.execute(
            "INSERT INTO pacerd.destinations (destination) SELECT unnest($1::text[])", names
        )
        await conn.execute(
            "INSERT INTO pacerd.jobs (job_id, kind, destination, max_attempts, next_attempt_at,"
            " payload)"
            " SELECT d || '-' || k, 'k', d, 10,"
            "        $2::timestamptz - interval '1 hour' + k * interval '1 second', '{}'"
            " FROM unnest($1::text[]) d, generate_series(1, $3::int) k",
            names, NOW, per,
        )  # fmt: skip
        await conn.execute("ANALYZE pacerd.jobs")
        sql = ledger.load_queries()["claim_due"].sql
        args = (names, [0] * n, [2] * n, [30.0] * n, [1] * n, [60.0] * n, NOW, "plan")
        tx = conn.transaction()
        await tx.start()
        try:
            raw = await conn.fetchval(f"EXPLAIN (ANALYZE, FORMAT JSON) {sql}", *args)
            await tx.rollback()
            tx = conn.transaction()
            await tx.start()
            rows = await conn.fetch(sql, *args)
        finally:
            await tx.rollback()
    finally:
        await conn.close()
    plan = (json.loads(raw) if isinstance(raw, str) else raw)[0]["Plan"]
    rescanned = [
        (node.get("CTE Name"), node["Actual Loops"])
        for node in nodes(plan)
        if node["Node Type"] == "CTE Scan" and node["Actual Loops"] > 1
    ]
    assert rescanned == []
    taken: dict[str, list[str]] = {}
    for row in rows:
        taken.setdefault(row["destination"], []).append(row["job_id"])
    assert taken == {d: [f"{d}-1", f"{d}-2"] for d in names}  # the two oldest of each
