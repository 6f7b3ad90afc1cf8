"""The publisher contract (``support.publisher_contract``) against the real
publisher on the real RabbitMQ, and against ``support.fakes.FakePublisher``
(the one the tick rig and the simulation use)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING

import aio_pika
import pytest
from support.fakes import FakePublisher
from support.publisher_contract import PublisherContract

from pacerd.errors import PublishError, PublishRejected
from pacerd.publisher import READY_EXCHANGE, Broker, ready_queue_name

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable

    from pacerd.models import ClaimedJob
    from pacerd.publisher import Publisher


@dataclass
class Driver:
    publisher: Publisher
    routed: str
    refusing: str


async def _refusing_queue(amqp_url: str, destination: str) -> None:
    """A queue bound for ``destination`` that holds nothing and refuses more:
    the broker nacks every message routed to it."""
    connection = await aio_pika.connect(amqp_url)
    try:
        channel = await connection.channel()
        queue = await channel.declare_queue(
            ready_queue_name(destination),
            arguments={"x-max-length": 0, "x-overflow": "reject-publish"},
        )
        await queue.bind(READY_EXCHANGE, routing_key=destination)
    finally:
        await connection.close()


async def _delete_queues(amqp_url: str, *destinations: str) -> None:
    connection = await aio_pika.connect(amqp_url)
    try:
        channel = await connection.channel()
        for destination in destinations:
            await channel.queue_delete(ready_queue_name(destination))
    finally:
        await connection.close()


@pytest.mark.services
class TestRealPublisher(PublisherContract):
    @pytest.fixture
    async def driver(self, amqp_url: str) -> AsyncIterator[Driver]:
        name = uuid.uuid4().hex[:8]
        routed, refusing = f"contract-{name}", f"contract-{name}-full"
        broker = Broker(url=amqp_url)
        await broker.connect()
        try:
            await broker.declare_destination(routed, ready_queue_name(routed))
            await _refusing_queue(amqp_url, refusing)
            yield Driver(publisher=broker, routed=routed, refusing=refusing)
        finally:
            await broker.close()
            await _delete_queues(amqp_url, routed, refusing)


def _nack(refusing: str) -> Callable[[ClaimedJob], PublishError | None]:
    def outcome(job: ClaimedJob) -> PublishError | None:
        if job.destination == refusing:
            return PublishRejected("the broker refused the message (fake nack)")
        return None

    return outcome


class TestFakePublisher(PublisherContract):
    @pytest.fixture
    async def driver(self) -> Driver:
        routed, refusing = "contract-d", "contract-d-full"
        publisher = FakePublisher(routes=set(), outcome=_nack(refusing))
        for destination in (routed, refusing):
            await publisher.declare_destination(destination, ready_queue_name(destination))
        return Driver(publisher=publisher, routed=routed, refusing=refusing)
