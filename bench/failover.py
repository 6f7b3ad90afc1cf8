"""Failover benchmark: kill -9 the leader of a busy destination, N times, and
measure how long the standby takes to resume admitting, and whether the
takeover admits more than the budget.

    .venv/bin/python bench/failover.py --kills 10 --tick 1.0 --rate 40

Two `pacerd run` instances lead/stand by for one destination (the ledger has
one partition, its own) with a deep backlog and a worker pool reporting `ok`;
each round kills the leader with SIGKILL and starts a fresh standby. Takeover
time = the new leader's first claim (`pacerd.job_events`, database clock)
minus the kill (same host clock).
Per-tick admission = a tick's claims over its logged budget (at most 1 by
construction: a tick never claims past its budget). The upstream's view, which
can exceed it: the claims of every instance in any one second of wall time
across each failover (from two seconds before the kill to five ticks after the
new leader's first claim), against the rate.

Needs the local PostgreSQL and RabbitMQ (override with PACERD_BENCH_DSN, a
maintenance-database URL, and PACERD_BENCH_AMQP_URL). Creates and drops its
own database and RabbitMQ virtual host.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import os
import random
import statistics
import sys
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import anyio
import asyncpg

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "e2e"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the support package
from ha_helpers import (  # the e2e helpers: instances, ledger queries
    ClaimGroup,
    Cluster,
    Pacing,
    Tick,
    claim_groups,
    first_claim_after,
    leaders,
    ok_workers,
    schedule_backlog,
    set_partitions,
)

from bench import common
from pacerd import ledger

ADMIN_DSN = os.environ.get("PACERD_BENCH_DSN", "postgresql://postgres@127.0.0.1:5432/postgres")
AMQP_URL = os.environ.get("PACERD_BENCH_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")


async def _admin(sql: str) -> None:
    conn = await asyncpg.connect(ADMIN_DSN)
    try:
        await conn.execute(sql)
    finally:
        await conn.close()


@dataclass(frozen=True, slots=True)
class Round:
    kill: int
    victim: str
    killed_at: dt.datetime
    took: ClaimGroup  # the new leader's first claim

    @property
    def takeover_seconds(self) -> float:
        return (self.took.at - self.killed_at).total_seconds()


def busiest_second(groups: list[ClaimGroup]) -> int:
    """The most claims (any instance) in one second of wall time, over ``groups``."""
    second = dt.timedelta(seconds=1)
    ordered = sorted(groups, key=lambda g: g.at)
    best = total = j = 0
    for g in ordered:  # windows [g.at - 1 s, g.at], ending at each claim
        total += g.n
        while ordered[j].at <= g.at - second:
            total -= ordered[j].n
            j += 1
        best = max(best, total)
    return best


def _tick_of(group: ClaimGroup, ticks: list[Tick]) -> Tick | None:
    """The logged tick that made ``group`` (its instance's next completed tick)."""
    return next(
        (t for t in ticks if t.by == group.by and t.at >= group.at and t.claimed == group.n), None
    )


async def run(args: argparse.Namespace) -> int:
    tag = uuid.uuid4().hex[:8]
    database = f"pacerd_failover_{tag}"
    dsn = common.dsn_for(database, ADMIN_DSN)
    vhost = f"pacerd-failover-{tag}"
    amqp_url = AMQP_URL
    if common.rabbitmqctl("add_vhost", vhost):
        common.rabbitmqctl("set_permissions", "-p", vhost, "guest", ".*", ".*", ".*")
        amqp_url = urlunsplit(urlsplit(AMQP_URL)._replace(path=f"/{vhost}"))
    await _admin(f'CREATE DATABASE "{database}"')
    destination = f"busy-{tag}"
    tick = args.tick
    rng = random.Random(args.seed)
    rows: list[Round] = []
    try:
        await ledger.migrate(dsn)
        # One partition, the destination's: the other instance is its standby,
        # not the leader of half the partitions.
        await set_partitions(dsn, 1)
        await schedule_backlog(dsn, destination, int(args.rate * (args.kills * 12 + 30)))
        pacing = Pacing(
            tick_seconds=tick,
            initial_rate=min(5.0, args.rate),
            max_rate=args.rate,
            claim_seconds=5.0,
            reconcile_seconds=1.0,
        )
        with tempfile.TemporaryDirectory() as tmp:
            cluster = Cluster(Path(tmp), dsn=dsn, amqp_url=amqp_url, pacing=pacing)
            try:
                async with ok_workers(amqp_url, [destination]):
                    live = [cluster.start("f-1"), cluster.start("f-2")]
                    started = 2
                    for instance in live:
                        await instance.wait_event("leadership_session_connected", within=60)
                    for k in range(1, args.kills + 1):
                        with anyio.fail_after(60):
                            while (leader := (await leaders(dsn))[destination][0]) is None:  # noqa: ASYNC110 (polls the ledger)
                                await anyio.sleep(0.05)
                        victim = cluster.instances[leader]
                        await victim.wait_event("destination_active", destination=destination)
                        # busy at its persisted rate; a random phase, so that the
                        # kill is not in step with the standby's supervisor pass
                        await anyio.sleep(3 * tick + rng.uniform(0, tick))
                        killed_at = victim.kill9()
                        took = await first_claim_after(dsn, destination, killed_at, within=60)
                        started += 1
                        standby = cluster.start(f"f-{started}")
                        await standby.wait_event("leadership_session_connected", within=60)
                        await anyio.sleep(2 * tick)
                        rows.append(Round(k, victim.name, killed_at, took))
                        print(f"kill {k}: {victim.name} -> {took.by}", flush=True)
                    await anyio.sleep(2 * tick)
                await cluster.stop()
            finally:
                cluster.kill_all()
            groups = await claim_groups(dsn, destination)
            ticks = cluster.ticks(destination)
    finally:
        await _admin(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')
        if amqp_url != AMQP_URL:
            common.rabbitmqctl("delete_vhost", vhost)

    return report(rows, groups, ticks, tick=tick, rate=args.rate)


def report(
    rows: list[Round], groups: list[ClaimGroup], ticks: list[Tick], *, tick: float, rate: float
) -> int:
    logged = [t for t in ticks if t.claimed > 0]
    window = dt.timedelta(seconds=tick)
    second = dt.timedelta(seconds=1)
    print()
    print(f"tick {tick:g} s, max_rate {rate:g}/s, {len(rows)} kills of the leader (SIGKILL)")
    print()
    header = (
        f"{'kill':>4}  {'victim':>6} -> {'leader':<6}  {'takeover s':>10}  {'gap ticks':>9}"
        f"  {'rate before':>11}  {'rate after':>10}  {'1st claimed/budget':>18}"
        f"  {'max claimed/budget':>18}  {'busiest 1 s':>11}  {'2-leader windows':>16}"
    )
    print(header)
    print("-" * len(header))
    worst_ratio = 0.0
    worst_second = 0
    overlaps = 0
    for row in rows:
        before = [t for t in logged if t.by == row.victim and t.at <= row.killed_at]
        last_old = max((g.at for g in groups if g.by == row.victim), default=None)
        gap = (row.took.at - last_old).total_seconds() / tick if last_old else float("nan")
        first = _tick_of(row.took, logged)
        span = [g for g in groups if row.killed_at - 2 * window <= g.at <= row.took.at + 5 * window]
        ratio = 0.0
        two_leaders = 0
        for g in span:
            made = _tick_of(g, logged)
            if made is not None and made.budget > 0:
                ratio = max(ratio, g.n / made.budget)
            if len({h.by for h in groups if g.at <= h.at < g.at + window}) > 1:
                two_leaders += 1
        worst_ratio = max(worst_ratio, ratio)
        around = [
            g for g in groups if row.killed_at - 2 * second <= g.at <= row.took.at + 5 * window
        ]
        busiest = busiest_second(around)
        worst_second = max(worst_second, busiest)
        overlaps += two_leaders
        nan = float("nan")
        first_ratio = f"{first.claimed}/{first.budget}" if first else "-"
        print(
            f"{row.kill:>4}  {row.victim:>6} -> {row.took.by:<6}  {row.takeover_seconds:>10.3f}"
            f"  {gap:>9.2f}  {before[-1].rate if before else nan:>11.2f}"
            f"  {first.rate if first else nan:>10.2f}  {first_ratio:>18}"
            f"  {ratio:>18.2f}  {busiest:>11}  {two_leaders:>16}"
        )
    takeovers = [r.takeover_seconds for r in rows]
    print()
    print(
        f"takeover: median {statistics.median(takeovers):.3f} s, worst {max(takeovers):.3f} s"
        f" (bound: 2 x tick = {2 * tick:.3f} s + detection, immediate for a local kill -9)"
    )
    print(
        f"largest 1-second window of admissions across a failover: {worst_second} claims"
        f" = {worst_second / rate:.2f} x the rate ({rate:g}/s);"
        f" largest per-tick admission: {worst_ratio:.2f} x its budget (at most 1 by construction);"
        f" tick-long windows holding claims of two instances: {overlaps}"
    )
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--tick", type=float, default=1.0, help="tick_seconds (default 1.0)")
    parser.add_argument("--rate", type=float, default=40.0, help="max_rate of the destination")
    parser.add_argument("--seed", type=int, default=1, help="seeds the kill times' phase")
    args = parser.parse_args()
    return asyncio.run(run(args))


if __name__ == "__main__":
    raise SystemExit(main())
