"""``pacerd.round_trip_seconds`` with a real ledger and broker: the first job
of every release slice this instance published, its outcome applied by this
instance's own consumer, is timed once, from its publish confirmed to its
outcome applied."""

from __future__ import annotations

import io
from functools import partial

import anyio.to_thread
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
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from support.metrics import histogram_points

from pacerd.telemetry import METRIC_PUBLISH_CONFIRM, METRIC_ROUND_TRIP, setup_telemetry

pytestmark = [pytest.mark.services, pytest.mark.timeout(120)]


async def test_each_slice_released_here_is_timed_once_when_its_outcome_is_applied(
    db_dsn: str, amqp_url: str
) -> None:
    destination = unique("round-trip")
    queue = f"pacerd.ready.{destination}"
    await purge_outcomes(amqp_url)
    await schedule_many(db_dsn, destination, 40, prefix=destination)
    reader = InMemoryMetricReader()
    make = partial(
        setup_telemetry, "pacerd-test", "warning", "json",
        metric_readers=[reader], log_stream=io.StringIO(),
    )  # fmt: skip
    telemetry = await anyio.to_thread.run_sync(make)
    cfg = daemon_config(db_dsn, amqp_url, pacing__initial_rate=50)
    try:
        async with (
            running_daemon(cfg, telemetry=telemetry),
            worker_pool(amqp_url, [queue], WorkerPool()),
        ):
            await wait_for_states(db_dsn, lambda c: c.get("completed", 0) == 40, within=60)
        points = histogram_points(reader, METRIC_ROUND_TRIP)
        slices = histogram_points(reader, METRIC_PUBLISH_CONFIRM)
    finally:
        await delete_queues(amqp_url, [queue])
        await anyio.to_thread.run_sync(partial(telemetry.shutdown, timeout_seconds=2))
    [point] = points
    assert dict(point.attributes or {}) == {"destination": destination}
    # the first job of every release slice, each slice's outcomes applied here
    assert 1 <= point.count == sum(p.count for p in slices) <= 40
    # each from its publish confirmed to its outcome applied: more than nothing,
    # less than the offer lease (after it the report would be stale)
    assert 0 < point.min <= point.max < cfg.leases.offer_seconds
