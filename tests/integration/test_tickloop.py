"""The tick loop with a real ledger and broker: the destinations of one tick
share their statements, an idle destination is parked and costs nothing, and
a parked one wakes when it gets work, resuming its persisted pacer."""

from __future__ import annotations

import json

import anyio
import asyncpg
import pytest
from dispatch_helpers import (
    WorkerPool,
    daemon_config,
    delete_queues,
    purge_outcomes,
    running_daemon,
    schedule_many,
    unique,
    wait_for_states,
    worker_pool,
)

pytestmark = [pytest.mark.services, pytest.mark.timeout(180)]


async def persisted_rate(dsn: str, destination: str) -> float:
    conn = await asyncpg.connect(dsn)
    try:
        state = await conn.fetchval(
            "SELECT pacer_state FROM pacerd.destinations WHERE destination = $1", destination
        )
    finally:
        await conn.close()
    return float(json.loads(state)["pacer"]["rate"])


async def test_idle_destinations_are_parked_and_woken_by_new_work(
    db_dsn: str, amqp_url: str
) -> None:
    names = [unique("idle") for _ in range(20)]
    queues = [f"pacerd.ready.{n}" for n in names]
    await purge_outcomes(amqp_url)
    for name in names:
        await schedule_many(db_dsn, name, 30, prefix=name)
    cfg = daemon_config(
        db_dsn, amqp_url, pacing__initial_rate=5, pacing__max_rate=60, pacing__min_rate=1
    )
    try:
        async with (
            running_daemon(cfg) as (daemon, ticks),
            worker_pool(amqp_url, queues, WorkerPool()),
        ):
            loop = daemon.tickloop
            assert loop is not None
            await wait_for_states(db_dsn, lambda c: c.get("completed", 0) == 600, within=90)
            # The ticks of the 20 destinations shared their claims: far fewer
            # claim statements than destination ticks that claimed.
            claiming = sum(1 for t in ticks.ticks if t.claimed)
            claims = loop.shared.statements["claim_due"]
            assert claiming >= 20 * 6, claiming
            assert claims <= claiming / 4, (claims, claiming)
            # After its first tick, each destination's ticks were planned with
            # the others' (planner.py): one read for many.
            reads = loop.shared.statements["read_destination_inflight"]
            assert loop.planner.passes > 0
            assert reads <= len(ticks.ticks) / 4, (reads, len(ticks.ticks))

            with anyio.fail_after(30):  # nothing due, in flight or new: all parked
                while loop.active:
                    await anyio.sleep(0.05)
            rate = await persisted_rate(db_dsn, names[0])
            assert rate != 5.0  # it grew while it drained
            before = sum(loop.shared.statements.values())
            passes = loop.passes
            with anyio.fail_after(30):
                while loop.passes < passes + 10:
                    await anyio.sleep(0.05)
            assert sum(loop.shared.statements.values()) == before  # idle: no statement
            assert not loop.active

            seen = len(ticks.ticks)
            await schedule_many(db_dsn, names[0], 5, prefix=f"{names[0]}-more")
            await wait_for_states(db_dsn, lambda c: c.get("completed", 0) == 605, within=30)
            # A tick is reported once its releases are spread and its state is
            # saved, which can be after a worker completed what it released.
            with anyio.move_on_after(10):
                while not any(t.destination == names[0] for t in ticks.ticks[seen:]):
                    await anyio.sleep(0.05)
            woken = [t for t in ticks.ticks[seen:] if t.destination == names[0]]
            assert woken, "the destination with new work did not tick"
            assert woken[0].rate == rate  # resumed from the ledger, not initial_rate
            assert {t.destination for t in ticks.ticks[seen:]} == {names[0]}
    finally:
        await delete_queues(amqp_url, queues)


async def test_a_destination_slower_than_a_job_a_tick_ticks_once_a_job(
    db_dsn: str, amqp_url: str
) -> None:
    """Held at 1 job/s with ticks of 0.2 s, four ticks of five would send
    nothing: the pacer plans the next tick that has a job instead (a sparse
    plan), so the destination ticks about once a job, at the same pace."""
    name = unique("sparse")
    queue = f"pacerd.ready.{name}"
    jobs = 6
    await purge_outcomes(amqp_url)
    await schedule_many(db_dsn, name, jobs, prefix=name)
    cfg = daemon_config(
        db_dsn, amqp_url, pacing__initial_rate=1, pacing__max_rate=1, pacing__min_rate=0.5
    )
    try:
        async with (
            running_daemon(cfg) as (daemon, ticks),
            worker_pool(amqp_url, [queue], WorkerPool()),
        ):
            loop = daemon.tickloop
            assert loop is not None
            started = anyio.current_time()
            await wait_for_states(db_dsn, lambda c: c.get("completed", 0) == jobs, within=60)
            took = anyio.current_time() - started
            # a tick is recorded when it ends (its marks and state saved),
            # which a worker's outcome for its job may come before
            with anyio.move_on_after(10):
                while sum(t.claimed for t in ticks.ticks if t.destination == name) < jobs:
                    await anyio.sleep(0.05)
            mine = [t for t in ticks.ticks if t.destination == name]
            sent = [t for t in mine if t.claimed]
            assert sum(t.claimed for t in mine) == jobs
            # one job a second: the first goes at once, the last ~5 s later
            assert took >= (jobs - 1) / 1.0 * 0.8, took
            # every 0.2 s, on the schedule, would be about 5 ticks a job
            assert len(mine) <= len(sent) + 3, [(t.budget, t.claimed) for t in mine]
    finally:
        await delete_queues(amqp_url, [queue])
