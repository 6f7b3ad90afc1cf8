"""Tick cost against the size of the due backlog: pacerd's real tick
(``DestinationAdmission.run_once`` over the real ``Ledger`` and ``Broker``)
with 10,000 / 1,000,000 / 5,000,000 due rows, generated with
``generate_series``.

    .venv/bin/python -m bench.backlog                          # ~5 minutes
    .venv/bin/python -m bench.backlog --sizes 10000,1000000 --ticks 40

For each size (the database grows from one size to the next), a child
process runs ``--ticks`` ticks of budget ``--budget`` on a ``TickClock``:
virtual time that jumps to any deadline inside the current tick at once and
never past it, moved to the next tick's start by the bench, so the budget is
the same every tick and the sub-tick spacing costs no waiting: the duration
is the tick's own work — read the destination, count in-flight, claim,
publish with confirms, mark offered, save the pacer. After each tick, untimed, the
claimed jobs go back to the end of the due queue (due 30 minutes ago: behind
the seeded rows, which are due an hour ago, and outside the live window), so
the backlog keeps its size. A no-op consumer drains the ready queue. Printed per size: tick p50 /
p99, ``claim_due`` p50 / p99, peak RSS of the ticking process, and one
``due_summary`` (the daemon's status/metrics query, every 5 s) for scale.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from typing import TYPE_CHECKING, Any

import anyio
import asyncpg

from bench import common
from pacerd import pacer
from pacerd.admission import PHASE_SPAN_SECONDS, AdmissionConfig, DestinationAdmission
from pacerd.clock import ManualClock
from pacerd.ledger import Ledger
from pacerd.publisher import Broker

if TYPE_CHECKING:
    from pacerd.models import ClaimedJob

DB = "pacerd_bench_backlog"
TICK_SECONDS = 0.5


class TickClock(ManualClock):
    """Autojump, but only inside the current tick: a sleep past its end (the
    marker of offers between flushes) waits until the bench opens the next
    tick, so virtual time never runs ahead of the ticks while real confirms
    and statements are awaited."""

    def __init__(self, *, start: float) -> None:
        super().__init__(start=start, autojump=True)
        self.tick_end = start
        self._opened = anyio.Event()

    def open_tick(self, start: float, end: float) -> None:
        self.advance(max(0.0, start - self.monotonic()))
        self.tick_end = end
        opened, self._opened = self._opened, anyio.Event()
        opened.set()

    async def sleep_until(self, deadline: float) -> None:
        while deadline > self.tick_end:
            await self._opened.wait()
        await super().sleep_until(deadline)


class TimedLedger:
    """The real ledger, timing ``claim_due``."""

    def __init__(self, ledger: Ledger) -> None:
        self._ledger = ledger
        self.claim_seconds: list[float] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ledger, name)

    async def claim_due(self, destination: str, **kwargs: Any) -> list[ClaimedJob]:
        t0 = time.perf_counter()
        try:
            return await self._ledger.claim_due(destination, **kwargs)
        finally:
            self.claim_seconds.append(time.perf_counter() - t0)


async def child(dsn: str, ticks: int, budget: int) -> dict[str, Any]:
    """Runs in its own process: the ticks, then its own figures as JSON."""
    ledger = TimedLedger(await Ledger.connect(dsn))
    broker = Broker(url=common.AMQP_URL, queue_type="quorum", publish_timeout_seconds=30)
    await broker.connect()
    await broker.declare_destination(common.DESTINATION, common.READY_QUEUE)
    clock = TickClock(start=1000.0)
    params = pacer.PacingParams(
        tick_seconds=TICK_SECONDS,
        initial_rate=budget / TICK_SECONDS,
        min_rate=1.0,
        max_rate=budget / TICK_SECONDS,
        max_inflight=10 * budget,
    )
    admission = DestinationAdmission(
        ledger=ledger,
        publisher=broker,
        clock=clock,
        config=AdmissionConfig(
            destination=common.DESTINATION,
            queue=common.READY_QUEUE,
            params=params,
            claim_seconds=60,
            offer_seconds=600,
            instance="bench",
        ),
    )
    recycle = await ledger.pool.acquire()
    durations: list[float] = []
    admitted = 0
    try:
        for k in range(ticks + 3):
            start = 1000.0 + k * TICK_SECONDS
            # a tick's release points are shifted by up to PHASE_SPAN_SECONDS:
            # its last one may fall that much past the tick's end
            clock.open_tick(start, start + TICK_SECONDS + PHASE_SPAN_SECONDS)
            t0 = time.perf_counter()
            result = await admission.run_once()
            if k >= 3:  # the first ticks warm up the pacer (slow start, credit)
                durations.append(time.perf_counter() - t0)
                admitted += result.offered
            await recycle.execute(
                "UPDATE pacerd.jobs SET state = 'scheduled', lease_expires_at = NULL,"
                " claimed_by = NULL, next_attempt_at = now() - interval '30 minutes'"
                " WHERE state IN ('claimed', 'offered')"
            )
        t0 = time.perf_counter()
        await ledger.due_summary()
        due_summary = time.perf_counter() - t0
    finally:
        await ledger.pool.release(recycle)
        await broker.close()
        await ledger.close()
    sample = common.proc_sample(os.getpid())
    return {
        "tick": durations,
        "claim": ledger.claim_seconds[3:],
        "admitted_per_tick": admitted / max(1, len(durations)),
        "hwm_mb": sample.hwm_mb,
        "rss_mb": sample.rss_mb,
        "due_summary": due_summary,
    }


async def grow_to(dsn: str, have: int, size: int) -> int:
    if size > have:
        seconds = await common.seed(dsn, size - have, prefix=f"s{size}")
        print(f"  seeded {size - have:,} rows in {seconds:.0f} s", flush=True)
    return size


async def measure(args: argparse.Namespace) -> str:
    sizes = sorted(int(s) for s in args.sizes.split(","))
    dsn = await common.fresh_ledger(DB)
    rows = []
    have = 0
    try:
        for size in sizes:
            have = await grow_to(dsn, have, size)
            conn = await asyncpg.connect(dsn)
            try:
                await conn.execute("VACUUM ANALYZE pacerd.jobs")
                due = await conn.fetchval(
                    "SELECT count(*) FROM pacerd.jobs WHERE state = 'scheduled'"
                )
            finally:
                await conn.close()
            await common.reset_queues()
            worker = common.start_worker("ack")
            try:
                proc = await asyncio.create_subprocess_exec(
                    sys.executable, "-m", "bench.backlog", "--child", dsn,
                    "--ticks", str(args.ticks), "--budget", str(args.budget),
                    stdout=asyncio.subprocess.PIPE, cwd=common.ROOT,
                )  # fmt: skip
                stdout, _ = await asyncio.wait_for(proc.communicate(), 600)
                if proc.returncode:
                    raise RuntimeError(f"the ticking process failed ({proc.returncode})")
            finally:
                common.stop_process(worker)
            got = json.loads(stdout.decode().strip().splitlines()[-1])
            row = (
                f"{due:,}",
                1000 * common.percentile(got["tick"], 50),
                1000 * common.percentile(got["tick"], 99),
                1000 * common.percentile(got["claim"], 50),
                1000 * common.percentile(got["claim"], 99),
                got["admitted_per_tick"],
                got["hwm_mb"],
                1000 * got["due_summary"],
            )
            print(f"  {row}", flush=True)
            rows.append(row)
    finally:
        await common.reset_queues()
        if not args.keep:
            await common.drop_database(DB)
    table = common.table(
        ["due rows", "tick p50 ms", "tick p99 ms", "claim p50 ms", "claim p99 ms",
         "jobs / tick", "peak RSS MB", "due_summary ms"],
        rows,
    )  # fmt: skip
    first, last = rows[0], rows[-1]
    assert isinstance(first[2], float)
    assert isinstance(last[2], float)
    table += f"\n\ntick p99 at {last[0]} / at {first[0]}: {last[2] / first[2]:.2f}×"
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="10000,1000000,5000000")
    parser.add_argument("--ticks", type=int, default=60, help="measured ticks per size")
    parser.add_argument("--budget", type=int, default=500, help="jobs per tick")
    parser.add_argument("--keep", action="store_true", help="keep the database afterwards")
    parser.add_argument("--child", metavar="DSN", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        import uvloop

        print(json.dumps(uvloop.run(child(args.child, args.ticks, args.budget))))
        return
    print(f"# backlog — {time.strftime('%Y-%m-%d %H:%M:%S %Z')}")
    print(f"# {common.machine_description()}")
    print(f"# budget {args.budget} jobs per tick, {args.ticks} measured ticks per size")
    print(common.run(lambda: measure(args)))


if __name__ == "__main__":
    main()
