"""The claim path of the ledger alone (no broker): ``claim_due`` batches
followed by ``mark_offered`` for each batch, on a scratch database of N due
rows that this script creates and drops itself.

    .venv/bin/python -m bench.claim                        # 10k and 1M rows, ~5 minutes
    .venv/bin/python -m bench.claim --rows 1000000 --batch 500
    .venv/bin/python -m bench.claim --rows 10000 --no-plans
    .venv/bin/python -m bench.claim --destinations 1000 --per 2   # one tick's claim for many

For every backlog size and batch size it prints rows/s, and p50/p99 of the
per-batch latency (claim + confirm, and the claim alone), and for a batch of
500 at every size the ``EXPLAIN (ANALYZE, BUFFERS)`` of the claim. The claim
runs as the tick runs it: a live share of a fifth reserved (unused here: the
backlog is all overdue), a 60 s live window, oldest first.

The statement is the daemon's own ``claim_due`` from ``queries.sql``.

``--destinations N`` measures instead the claim of one tick for N
destinations (100 due jobs each), ``--per`` jobs each, as the tick loop
sends it: one statement, rolled back after each of ``--repeat`` runs (and
a first one, not counted, that warms the caches); it
prints the statement's p50 and max.

Each (size, batch) run claims at most ``--max-batches`` batches or
``--max-seconds`` seconds, whichever comes first; the claimed rows are then
put back and the table vacuumed, so every run starts from the same backlog.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import time
import uuid
from typing import TYPE_CHECKING

import asyncpg

from bench import common
from pacerd import ledger

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

DESTINATION = common.DESTINATION
LIVE_WINDOW_SECONDS = 60.0
PLAN_BATCH = 500


async def seed(conn: asyncpg.Connection, rows: int, chunk: int = 250_000) -> float:
    """N overdue first attempts of one destination (~200 B payloads), oldest first."""
    t0 = time.perf_counter()
    await conn.execute(
        "INSERT INTO pacerd.destinations (destination) VALUES ($1) ON CONFLICT DO NOTHING",
        DESTINATION,
    )
    for first in range(1, rows + 1, chunk):
        last = min(rows, first + chunk - 1)
        await conn.execute(
            "INSERT INTO pacerd.jobs (job_id, kind, destination, max_attempts, next_attempt_at,"
            " payload)"
            " SELECT 'job-' || g, 'bench', $1, 10,"
            "        now() - interval '30 days' + g * interval '1 millisecond',"
            "        jsonb_build_object('n', g, 'pad', repeat('x', 160))"
            " FROM generate_series($2::int, $3::int) g",
            DESTINATION,
            first,
            last,
        )
    await conn.execute("VACUUM (ANALYZE) pacerd.jobs")
    return time.perf_counter() - t0


async def reset(conn: asyncpg.Connection) -> None:
    """Puts every claimed or offered row back, as seeded, and cleans up."""
    await conn.execute(
        "UPDATE pacerd.jobs SET state = 'scheduled', attempt = 0, lease_expires_at = NULL,"
        " ever_offered = false, claimed_by = NULL, admit_epoch = 0"
        " WHERE state <> 'scheduled'"
    )
    await conn.execute("TRUNCATE pacerd.job_events")
    await conn.execute("VACUUM (ANALYZE) pacerd.jobs")


def percentile(values: list[float], q: float) -> float:
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[round(q) - 1]


async def run_batches(
    led: ledger.Ledger, batch: int, *, max_batches: int, max_seconds: float
) -> dict[str, float]:
    per_batch: list[float] = []
    claim_only: list[float] = []
    claimed = 0
    start = time.perf_counter()
    for _ in range(max_batches):
        t0 = time.perf_counter()
        jobs = await led.claim_due(
            DESTINATION,
            live_limit=batch // 5,
            limit=batch,
            claim_seconds=30.0,
            epoch=0,
            live_window_seconds=LIVE_WINDOW_SECONDS,
            instance="bench",
        )
        t1 = time.perf_counter()
        if not jobs:
            break
        offered = await led.mark_offered([j.ref for j in jobs], offer_seconds=60.0)
        t2 = time.perf_counter()
        assert len(offered) == len(jobs), "a confirm was lost"
        claimed += len(jobs)
        per_batch.append(t2 - t0)
        claim_only.append(t1 - t0)
        if t2 - start > max_seconds:
            break
    elapsed = sum(per_batch)
    return {
        "batches": len(per_batch),
        "rows": claimed,
        "rows_per_s": claimed / elapsed if elapsed else 0.0,
        "p50_ms": 1000 * percentile(per_batch, 50),
        "p99_ms": 1000 * percentile(per_batch, 99),
        "claim_p50_ms": 1000 * percentile(claim_only, 50),
        "claim_p99_ms": 1000 * percentile(claim_only, 99),
    }


async def explain(conn: asyncpg.Connection, sql: str, batch: int) -> tuple[str, int, float]:
    """EXPLAIN (ANALYZE, BUFFERS) of one claim, rolled back: (plan, buffers, ms)."""
    tx = conn.transaction()
    await tx.start()
    try:
        rows = await conn.fetch(
            f"EXPLAIN (ANALYZE, BUFFERS) {sql}",
            [DESTINATION],
            [batch // 5],
            [batch],
            [30.0],
            [0],
            [LIVE_WINDOW_SECONDS],
            None,
            "bench-explain",
        )
    finally:
        await tx.rollback()
    text = "\n".join(r[0] for r in rows)
    # The top node's buffers (inclusive of the claim's UPDATE) plus the history
    # INSERT's (a CTE nothing reads, run on its own).
    lines = text.splitlines()
    starts = [0, *[i for i, line in enumerate(lines) if "Insert on job_events" in line][:1]]
    buffers = 0
    for start in starts:
        line = next((x for x in lines[start:] if "Buffers: shared" in x), "")
        for part in line.replace(",", " ").split():
            if part.startswith(("hit=", "read=")):
                buffers += int(part.split("=")[1])
    ms = next(
        (float(line.split()[2]) for line in text.splitlines() if line.startswith("Execution")),
        0.0,
    )
    return text, buffers, ms


@contextlib.asynccontextmanager
async def scratch_ledger(keep: bool) -> AsyncIterator[str]:
    """A migrated scratch database for one run (its DSN), dropped after it
    unless ``keep``."""
    name = f"pacerd_bench_claim_{uuid.uuid4().hex[:8]}"
    try:
        yield await common.fresh_ledger(name)
    finally:
        if not keep:
            await common.drop_database(name)


async def bench_size(args: argparse.Namespace, rows: int) -> list[str]:
    lines: list[str] = []
    async with scratch_ledger(args.keep) as dsn:
        conn = await asyncpg.connect(dsn)
        led = await ledger.Ledger.connect(dsn, max_size=2)
        try:
            seconds = await seed(conn, rows)
            print(f"\n== {rows:,} due rows (seeded in {seconds:.1f} s) ==", flush=True)
            sql = led.queries["claim_due"].sql
            for variant in ("claim_due",):
                plan, buffers, ms = await explain(conn, sql, PLAN_BATCH)
                summary = (
                    f"{rows:>9,} rows  {variant:9s}  EXPLAIN batch {PLAN_BATCH}:"
                    f" {buffers:,} buffers, {ms:.1f} ms"
                )
                print(summary, flush=True)
                lines.append(summary)
                if args.plans:
                    print(plan, flush=True)
                for batch in args.batch:
                    result = await run_batches(
                        led, batch, max_batches=args.max_batches, max_seconds=args.max_seconds
                    )
                    await reset(conn)
                    line = (
                        f"{rows:>9,} rows  {variant:9s}  batch {batch:>5}:"
                        f" {result['rows_per_s']:>9,.0f} rows/s"
                        f"  p50 {result['p50_ms']:7.1f} ms  p99 {result['p99_ms']:7.1f} ms"
                        f"  (claim alone p50 {result['claim_p50_ms']:7.1f}"
                        f" p99 {result['claim_p99_ms']:7.1f} ms;"
                        f" {int(result['batches'])} batches, {int(result['rows']):,} rows)"
                    )
                    print(line, flush=True)
                    lines.append(line)
        finally:
            await led.close()
            await conn.close()
    return lines


async def bench_destinations(args: argparse.Namespace) -> None:
    """One claim statement for ``--destinations`` destinations, timed."""
    n, per = args.destinations, args.per
    async with scratch_ledger(args.keep) as dsn:
        # the session as the daemon's pool opens it (JIT off: with it on, a
        # connection's first custom plans of this statement compile for ~0.7 s)
        conn = await asyncpg.connect(dsn, server_settings=dict(ledger.SESSION_SETTINGS))
        try:
            names = [f"tenant-{i:05d}" for i in range(n)]
            await conn.execute(
                "INSERT INTO pacerd.destinations (destination) SELECT unnest($1::text[])", names
            )
            await conn.execute(
                "INSERT INTO pacerd.jobs (job_id, kind, destination, max_attempts,"
                " next_attempt_at, payload)"
                " SELECT d || '-' || k, 'bench', d, 10,"
                "        now() - interval '1 hour' + k * interval '1 ms', '{}'"
                " FROM unnest($1::text[]) d, generate_series(1, 100) k",
                names,
            )
            await conn.execute("VACUUM (ANALYZE) pacerd.jobs")
            queries = ledger.load_queries()
            sql = queries["claim_due"].sql
            claim = (names, [0] * n, [per] * n, [30.0] * n, [0] * n, [LIVE_WINDOW_SECONDS] * n)
            times: list[float] = []
            reads: list[float] = []
            for run in range(args.repeat + 1):  # the first warms the caches: not counted
                # the tick planner's read: the rows and in-flight counts of every one
                t0 = time.perf_counter()
                rows = await conn.fetch(queries["read_destination"].sql, names, None, True)
                if run:
                    reads.append(time.perf_counter() - t0)
                assert len(rows) == n, len(rows)
                tx = conn.transaction()
                await tx.start()
                try:
                    t0 = time.perf_counter()
                    got = await conn.fetch(sql, *claim, None, "bench")
                    if run:
                        times.append(time.perf_counter() - t0)
                finally:
                    await tx.rollback()
                assert len(got) == n * per, len(got)
        finally:
            await conn.close()
    for what, values in (("claim", times), ("read (rows and in-flight counts)", reads)):
        print(
            f"{n:,} destinations x {per} jobs: one {what} statement p50"
            f" {1000 * statistics.median(values):.1f} ms, max {1000 * max(values):.1f} ms"
            f" ({len(values)} runs)",
            flush=True,
        )


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else "")
    parser.add_argument(
        "--rows", type=int, nargs="+", default=[10_000, 1_000_000], help="backlog sizes"
    )
    parser.add_argument("--batch", type=int, nargs="+", default=[100, 500, 1000])
    parser.add_argument("--max-batches", type=int, default=200, help="per (size, batch) run")
    parser.add_argument("--max-seconds", type=float, default=20.0, help="per (size, batch) run")
    parser.add_argument("--no-plans", dest="plans", action="store_false", help="no full plans")
    parser.add_argument("--keep", action="store_true", help="keep the scratch database")
    parser.add_argument("--destinations", type=int, default=0, help="one tick's claim for N")
    parser.add_argument("--per", type=int, default=2, help="with --destinations: jobs each")
    parser.add_argument("--repeat", type=int, default=20, help="with --destinations: runs")
    args = parser.parse_args()
    if args.destinations:
        await bench_destinations(args)
        return
    summary: list[str] = []
    for rows in args.rows:
        summary.extend(await bench_size(args, rows))
    print("\n== summary ==")
    print("\n".join(summary))


if __name__ == "__main__":
    asyncio.run(main())
