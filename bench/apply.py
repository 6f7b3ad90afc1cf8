"""Outcome application alone: reports/s through ``Ledger.apply_reports`` in
batches (one transaction each, as the outcome consumer does), with the
set-based ``pacerd.report_many`` (``queries.sql`` ``apply_reports``) beside
the statement it replaced (``pacerd.report`` called per row through unnest).

    .venv/bin/python -m bench.apply                  # ~1 minute
    .venv/bin/python -m bench.apply --jobs 20000 --batch 500 --repeat 3
"""

from __future__ import annotations

import argparse
import time

import asyncpg

from bench import common
from pacerd.ledger import Ledger, _report_batch
from pacerd.models import JobRef, Outcome, Report

DB = "pacerd_bench_apply"

PER_ROW_SQL = """
SELECT pacerd.report(job_id => r.job_id, attempt => r.attempt, outcome => r.outcome,
                     retry_after_s => r.retry_after_s, error => r.error,
                     detail => r.detail, cursor => r.cursor) AS result
FROM unnest($1::text[], $2::int[], $3::text[], $4::float8[], $5::text[], $6::jsonb[],
            $7::jsonb[]) WITH ORDINALITY AS r(job_id, attempt, outcome, retry_after_s, error,
                                             detail, cursor, n)
ORDER BY r.n
"""


async def _offered(led: Ledger, dsn: str, n: int) -> list[JobRef]:
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute("TRUNCATE pacerd.jobs, pacerd.job_events")
    finally:
        await conn.close()
    await common.seed(dsn, n)
    refs: list[JobRef] = []
    while True:
        jobs = await led.claim_due(
            common.DESTINATION, live_limit=0, limit=5000, claim_seconds=600, epoch=0,
            live_window_seconds=0, instance="bench",
        )  # fmt: skip
        if not jobs:
            return refs
        got = await led.mark_offered([j.ref for j in jobs], offer_seconds=600)
        refs.extend(got)


async def apply_rate(led: Ledger, dsn: str, *, n: int, batch: int, per_row: bool) -> float:
    refs = await _offered(led, dsn, n)
    reports = [Report(job_id=r.job_id, attempt=r.attempt, outcome=Outcome.OK) for r in refs]
    t0 = time.perf_counter()
    for i in range(0, len(reports), batch):
        chunk = reports[i : i + batch]
        if per_row:
            async with led.transaction() as conn:
                results = await _report_batch(conn, PER_ROW_SQL, chunk)
        else:
            results = await led.apply_reports(chunk)
        assert results == ["applied"] * len(chunk), results[:3]
    return len(reports) / (time.perf_counter() - t0)


async def measure(args: argparse.Namespace) -> str:
    dsn = await common.fresh_ledger(DB)
    led = await Ledger.connect(dsn)
    rows = []
    try:
        for label, per_row in (
            ("pacerd.report per row (before)", True),
            ("pacerd.report_many, set-based (after)", False),
        ):
            values = [
                await apply_rate(led, dsn, n=args.jobs, batch=args.batch, per_row=per_row)
                for _ in range(args.repeat)
            ]
            print(f"  {label}: {', '.join(f'{v:,.0f}' for v in values)} reports/s", flush=True)
            rows.append((label, common.median(values)))
    finally:
        await led.close()
        await common.drop_database(DB)
    return common.table([f"ok reports, batch {args.batch}", "reports/s (median)"], rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=20_000)
    parser.add_argument("--batch", type=int, default=500)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    print(f"# apply — {time.strftime('%Y-%m-%d %H:%M:%S %Z')}")
    print(f"# {common.machine_description()}")
    print(common.run(lambda: measure(args)))


if __name__ == "__main__":
    main()
