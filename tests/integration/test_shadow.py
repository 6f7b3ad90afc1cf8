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
