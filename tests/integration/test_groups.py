"""Destination groups against the real PostgreSQL and RabbitMQ: one shared ready
queue per group, routed by the group's name; the worker library consuming it;
per-destination overrides on top of the group's keys; queues declared once per
broker connection, not per supervisor pass."""

from __future__ import annotations

import json
from collections import Counter
from typing import TYPE_CHECKING, Any

import aio_pika
import aio_pika.exceptions
import anyio
import pytest
from dispatch_helpers import (
    close_broker_connections,
    daemon_config,
    delete_queues,
    purge_outcomes,
    running_daemon,
    schedule_many,
    unique,
    wait_for_states,
)

from pacerd.worker import Worker, WorkerApp

if TYPE_CHECKING:
    from collections.abc import Callable

    from pacerd.daemon import Daemon
    from pacerd.protocol import Job

pytestmark = [pytest.mark.services, pytest.mark.timeout(120)]


def group_overrides(group: str, prefix: str, **keys: object) -> dict[str, object]:
    return {f"groups__{group}__match": f"{prefix}-*"} | {
        f"groups__{group}__{key}": value for key, value in keys.items()
    }


async def queue_depth(amqp_url: str, name: str) -> int | None:
    """Ready messages in ``name``; None when the queue does not exist."""
    connection = await aio_pika.connect(amqp_url)
    try:
        channel = await connection.channel()
        try:
            queue = await channel.declare_queue(name, passive=True)
        except aio_pika.exceptions.ChannelNotFoundEntity:
            return None
        count = queue.declaration_result.message_count
        assert count is not None
        return count
    finally:
        await connection.close()


async def peek(amqp_url: str, name: str, count: int) -> Counter[tuple[str, str]]:
    """(routing key, body destination) of ``count`` messages of ``name``, all
    left in the queue (unacknowledged, so they return when the channel closes)."""
    seen: Counter[tuple[str, str]] = Counter()
    connection = await aio_pika.connect(amqp_url)
    try:
        channel = await connection.channel()
        queue = await channel.get_queue(name, ensure=False)
        for _ in range(count):
            message = await queue.get(no_ack=False, fail=True)
            assert message is not None
            seen[(message.routing_key or "", json.loads(message.body)["destination"])] += 1
    finally:
        await connection.close()
    return seen


async def test_a_group_shares_one_queue_routed_by_its_name(db_dsn: str, amqp_url: str) -> None:
    prefix, group, solo = unique("tenant"), unique("grp"), unique("solo")
    members = [f"{prefix}-{x}" for x in ("a", "b", "vip")]
    shared = f"pacerd.ready.{group}"
    queues = [shared, f"pacerd.ready.{solo}", *(f"pacerd.ready.{m}" for m in members)]
    await purge_outcomes(amqp_url)
    for member in members:
        await schedule_many(db_dsn, member, 12, prefix=member)
    await schedule_many(db_dsn, solo, 6, prefix=solo)
    overrides = group_overrides(group, prefix, initial_rate=5, max_rate=5)
    overrides |= {f"destinations__{members[2]}__initial_rate": 400}
    overrides |= {f"destinations__{members[2]}__max_rate": 400}
    cfg = daemon_config(db_dsn, amqp_url, **overrides)
    try:
        async with running_daemon(cfg) as (daemon, ticks):
            await wait_for_states(db_dsn, lambda c: c.get("offered", 0) == 42, within=60)
            assert await queue_depth(amqp_url, shared) == 36
            assert await queue_depth(amqp_url, f"pacerd.ready.{solo}") == 6
            for member in members:  # no queue of their own
                assert await queue_depth(amqp_url, f"pacerd.ready.{member}") is None
            assert await peek(amqp_url, shared, 36) == {(group, m): 12 for m in members}
            assert await peek(amqp_url, f"pacerd.ready.{solo}", 6) == {(solo, solo): 6}

            assert daemon.tickloop is not None
            active = daemon.tickloop.active  # the members are in flight: active
            params = {m: active[m].admission.config.params for m in members}
            assert [(p.initial_rate, p.max_rate) for p in params.values()] == [
                (5.0, 5.0),
                (5.0, 5.0),
                (400.0, 400.0),  # [destinations.NAME] on top of the group's keys
            ]

            app = WorkerApp(groups=[group], destinations=[solo], check_current=False)
            by_destination: list[str] = []
            anything: Counter[str] = Counter()

            @app.handler(destination=members[0])
            async def first(job: Job) -> dict[str, Any]:
                by_destination.append(job.destination)
                return {}

            @app.handler()
            async def other(job: Job) -> dict[str, Any]:
                anything[job.destination] += 1
                return {}

            worker = Worker.from_config(app, cfg)
            assert set(worker.queues.items()) == {(group, shared), (solo, f"pacerd.ready.{solo}")}
            async with anyio.create_task_group() as tg:
                await tg.start(worker.run)
                with anyio.fail_after(60):
                    await worker.wait_until(lambda s: s.reported >= 42)
                worker.request_stop()
            await wait_for_states(db_dsn, lambda c: c.get("completed", 0) == 42, within=60)
    finally:
        await delete_queues(amqp_url, queues)

    assert by_destination == [members[0]] * 12  # handler lookup by destination
    assert anything == {members[1]: 12, members[2]: 12, solo: 6}
    assert worker.stats.outcomes == {"ok": 42}
    rates = {
        m: {t.rate for t in ticks.ticks if t.destination == m and not t.skipped} for m in members
    }
    for member in members[:2]:  # the group's max_rate
        assert rates[member], member
        assert max(rates[member]) <= 5.0
    assert rates[members[2]] == {400.0}


async def wait_passes(daemon: Daemon, passes: Callable[[], int], more: int) -> None:
    """Returns after ``more`` further supervisor passes."""
    target = passes() + more
    with anyio.fail_after(30):
        while passes() < target:
            await anyio.sleep(0.05)


async def test_queues_are_declared_once_per_broker_connection(db_dsn: str, amqp_url: str) -> None:
    prefix, group, solo, later = unique("tenant"), unique("grp"), unique("solo"), unique("late")
    members = [f"{prefix}-{x}" for x in ("a", "b", "c")]
    queues = [f"pacerd.ready.{n}" for n in (group, solo, later, *members, f"{prefix}-d")]
    for destination in (*members, solo):
        await schedule_many(db_dsn, destination, 1, prefix=destination, eligible_in_seconds=3600)
    cfg = daemon_config(db_dsn, amqp_url, **group_overrides(group, prefix))
    try:
        async with running_daemon(cfg) as (daemon, _ticks):
            assert daemon.tickloop is not None
            loop = daemon.tickloop

            def passes() -> int:
                return loop.passes

            # declared before READY: the group's queue and solo's
            assert daemon.broker.declarations == 2
            await wait_passes(daemon, passes, 5)
            assert daemon.broker.declarations == 2

            # a new grouped destination uses the declared queue; a new ungrouped one has its own
            for destination in (f"{prefix}-d", later):
                await schedule_many(
                    db_dsn, destination, 1, prefix=destination, eligible_in_seconds=3600
                )
            with anyio.fail_after(30):
                while daemon.broker.declarations < 3:
                    await anyio.sleep(0.05)
            await wait_passes(daemon, passes, 3)
            assert daemon.broker.declarations == 3
            assert await queue_depth(amqp_url, f"pacerd.ready.{later}") == 0
            assert await queue_depth(amqp_url, f"pacerd.ready.{prefix}-d") is None

            # named like the group but outside its match: it would share the
            # group's routing key, so it is not admitted
            await schedule_many(db_dsn, group, 1, prefix=group)
            await wait_passes(daemon, passes, 3)
            assert group in daemon.supervisor.shadows
            assert group not in loop.active
            assert await queue_depth(amqp_url, f"pacerd.ready.{group}") == 0
            assert daemon.broker.declarations == 3

            # a new connection declares the group's queue again at once, and a
            # destination's own queue again when it next has work, once
            cut = await anyio.to_thread.run_sync(
                close_broker_connections, f"pacerd {daemon.instance}"
            )
            assert cut == 1
            with anyio.fail_after(30):
                while daemon.broker.declarations < 4:
                    await anyio.sleep(0.05)
            await wait_passes(daemon, passes, 3)
            assert daemon.broker.declarations == 4
            await schedule_many(db_dsn, later, 1, prefix=f"{later}-now")
            with anyio.fail_after(30):
                while daemon.broker.declarations < 5:
                    await anyio.sleep(0.05)
            await wait_passes(daemon, passes, 3)
            assert daemon.broker.declarations == 5
    finally:
        await delete_queues(amqp_url, queues)
