"""Shadow mode: every decision computed and reported, nothing claimed."""

from __future__ import annotations

import anyio
import pytest
from dispatch_helpers import daemon_config, running_daemon, schedule_many, state_counts, unique

pytestmark = [pytest.mark.services, pytest.mark.timeout(60)]


async def test_shadow_mode_computes_budgets_and_claims_nothing(db_dsn: str, amqp_url: str) -> None:
    destination = unique("shadow")
    await schedule_many(db_dsn, destination, 300, prefix=destination)
    cfg = daemon_config(db_dsn, amqp_url, PACING__MODE="shadow", PACING__INITIAL_RATE="100")
    async with running_daemon(cfg) as (daemon, ticks):
        with anyio.fail_after(20):
            while sum(t.claimed for t in ticks.ticks if t.destination == destination) < 50:
                await anyio.sleep(0.1)
        # It leads partitions (it computes their decisions) but never takes the
        # reconciler's lock: holding it, it would stop the active instances' reconciling.
        assert daemon.leadership is not None
        assert daemon.leadership.held()
        assert daemon.leadership.passes > 3
        assert not daemon.leadership.reconciles()
    mine = [t for t in ticks.ticks if t.destination == destination]
    assert all(t.shadow for t in mine)
    assert all(t.offered == 0 and t.claimed <= t.budget for t in mine)
    assert sum(t.budget for t in mine) >= 50
    assert await state_counts(db_dsn) == {"scheduled": 300}


async def test_shadow_ticks_of_many_destinations_share_their_due_counts(
    db_dsn: str, amqp_url: str
) -> None:
    """A shadow tick counts what it would have claimed (``has_due``); the
    ticks of many destinations planned together count theirs in one
    statement, not one each."""
    names = [unique("shadow-many") for _ in range(12)]
    for name in names:
        await schedule_many(db_dsn, name, 30, prefix=name)
    cfg = daemon_config(db_dsn, amqp_url, PACING__MODE="shadow", PACING__INITIAL_RATE="5")
    async with running_daemon(cfg) as (daemon, ticks):
        loop = daemon.tickloop
        assert loop is not None
        with anyio.fail_after(30):
            while len({t.destination for t in ticks.ticks if t.claimed}) < len(names) or (
                sum(1 for t in ticks.ticks if t.budget) < 6 * len(names)
            ):
                await anyio.sleep(0.1)
        counted = sum(1 for t in ticks.ticks if t.destination in names and t.budget)
        sent = loop.ledger.statements  # the ledger's statements, by name
        single, many = sent["has_due"], sent["has_due_many"]
    mine = [t for t in ticks.ticks if t.destination in names]
    assert all(t.shadow and t.offered == 0 for t in mine)
    # each counted what it would have claimed: at most its budget, all of it here
    assert all(t.claimed == t.budget for t in mine if t.budget), [
        (t.claimed, t.budget) for t in mine
    ]
    assert single == 0, single
    assert 0 < many <= counted / 4, (many, counted)
    assert await state_counts(db_dsn) == {"scheduled": 30 * len(names)}
