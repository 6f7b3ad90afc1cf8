"""The minimal RabbitMQ permissions (``pacerd.roles``) against the real
broker: in a virtual host of its own, a daemon user and a worker user with
only those permissions run a full worker cycle — offers published, consumed
by the worker library, outcomes applied by the daemon's consumer, a
malformed offer parked — and the worker user is refused everything else."""

from __future__ import annotations

import contextlib
import shutil
import uuid
from typing import TYPE_CHECKING

import aio_pika
import aiormq
import anyio
import pytest
from role_helpers import login_role, rabbitmqctl
from support.services import amqp_url_for, with_user

from pacerd.client import Client
from pacerd.ledger import Ledger
from pacerd.publisher import INVALID_QUEUE, OUTCOMES_QUEUE, READY_EXCHANGE, Broker, ready_queue_name
from pacerd.roles import (
    DAEMON_BROKER_PERMISSIONS,
    BrokerPermissions,
    RoleNames,
    worker_broker_permissions,
)
from pacerd.testing import apply_outcomes, offer_due, take_parked
from pacerd.worker import Job, Worker, WorkerApp

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Iterator

    from aio_pika.abc import AbstractChannel, AbstractIncomingMessage

pytestmark = [pytest.mark.services, pytest.mark.timeout(120)]


@pytest.fixture
def vhost() -> Iterator[str]:
    if shutil.which("rabbitmqctl") is None:
        pytest.skip("rabbitmqctl is needed to create users and a virtual host")
    name = f"pacerd-perm-{uuid.uuid4().hex[:10]}"
    rabbitmqctl("add_vhost", name)
    try:
        yield name
    finally:
        rabbitmqctl("delete_vhost", name)


@contextlib.contextmanager
def broker_user(vhost: str, permissions: BrokerPermissions) -> Iterator[str]:
    """A user with only ``permissions`` in ``vhost``; yields its AMQP URL."""
    user, password = f"pacerd-perm-{uuid.uuid4().hex[:10]}", uuid.uuid4().hex
    rabbitmqctl("add_user", user, password)
    try:
        rabbitmqctl(*permissions.rabbitmqctl(vhost, user))
        yield with_user(amqp_url_for(vhost), user, password)
    finally:
        rabbitmqctl("delete_user", user)


async def test_a_least_privilege_worker_runs_a_full_cycle(db_dsn: str, vhost: str) -> None:
    destination = f"perm-{uuid.uuid4().hex[:8]}"
    queue = ready_queue_name(destination)
    roles = RoleNames()
    with (
        broker_user(vhost, DAEMON_BROKER_PERMISSIONS) as daemon_url,
        broker_user(vhost, worker_broker_permissions([queue])) as worker_url,
    ):
        ledger = await Ledger.connect(db_dsn, max_size=4)
        broker = Broker(daemon_url)
        try:
            await broker.connect()  # declares pacerd's exchanges and queues
            async with login_role(roles.producer) as producer, login_role(roles.worker) as user:
                client = await Client.connect(with_user(db_dsn, producer))
                try:
                    for n in range(3):
                        await client.schedule(
                            f"perm-{n}", kind="echo", destination=destination, payload={"n": n}
                        )
                    offered = await offer_due(ledger, broker, destination)
                    assert len(offered) == 3
                    # No longer current: the worker's is_current (as pacerd_worker) skips it.
                    assert await client.cancel("perm-2", "test") == "cancelled"
                finally:
                    await client.close()
                # An offer that names no job: the worker must park it.
                await broker.publish_raw(queue, b"not json")

                app = WorkerApp(destinations=[destination], check_current=True)

                @app.handler("echo")
                async def echo(job: Job) -> dict[str, object]:
                    return {"seen": job.payload["n"]}

                worker = Worker(app, broker_url=worker_url, dsn=with_user(db_dsn, user))
                with anyio.fail_after(60):
                    async with anyio.create_task_group() as tg:
                        await tg.start(worker.run)
                        await worker.wait_until(lambda s: s.reported + s.skipped + s.parked >= 4)
                        worker.request_stop()
                stats = worker.stats
                assert (stats.reported, stats.skipped, stats.parked) == (2, 1, 1)

            with anyio.fail_after(60):
                result = await apply_outcomes(ledger, broker, count=3)
                parked = await take_parked(daemon_url, queue, 1)
            assert (result.applied, result.invalid) == (2, 1)
            assert [m.body for m in parked] == [b"not json"]
            states = await ledger.pool.fetch(
                "SELECT state FROM pacerd.jobs WHERE destination = $1 ORDER BY job_id", destination
            )
            assert [s["state"] for s in states] == ["completed", "completed", "cancelled"]

            await _refused_everything_else(worker_url, queue)
        finally:
            await broker.close()
            await ledger.close()


async def _refused_everything_else(worker_url: str, queue: str) -> None:
    """The worker user may not declare, publish offers, read outcomes or use
    the default exchange; it may consume its own queue."""
    connection = await aio_pika.connect(worker_url)
    async with connection:
        channel = await connection.channel()
        await channel.declare_queue(queue, passive=True)  # allowed: checks, changes nothing
        attempts: dict[str, Callable[[AbstractChannel], Awaitable[object]]] = {
            "declare": lambda ch: ch.declare_queue("pacerd.ready.other", durable=True),
            "declare the outcomes queue": lambda ch: ch.declare_queue(
                OUTCOMES_QUEUE, durable=True, arguments={"x-queue-type": "quorum"}
            ),
            "read outcomes": lambda ch: _consume(ch, OUTCOMES_QUEUE),
            "read parked": lambda ch: _consume(ch, INVALID_QUEUE),
            "offer": lambda ch: _publish(ch, READY_EXCHANGE, queue),
            "default exchange": lambda ch: _publish(ch, "", queue),
        }
        for what, attempt in attempts.items():
            confirming = await connection.channel(publisher_confirms=True)
            with pytest.raises(aiormq.exceptions.ChannelAccessRefused):
                await attempt(confirming)
            assert confirming.is_closed, what


async def _consume(channel: AbstractChannel, name: str) -> None:
    async def ack(message: AbstractIncomingMessage) -> None:
        await message.ack()

    declared = await channel.declare_queue(name, passive=True)
    await declared.consume(ack)


async def _publish(channel: AbstractChannel, exchange: str, key: str) -> None:
    target = channel.default_exchange if exchange == "" else await channel.get_exchange(exchange)
    await target.publish(aio_pika.Message(b"{}"), routing_key=key)
