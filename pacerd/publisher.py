"""The broker side: RabbitMQ through aio-pika (connection, channels,
declarations) and the aiormq channels underneath them (publishing and
consuming, per message).

Owns the AMQP connection, the topology pacerd declares (docs/protocol.md,
"Messages"), publishing ready work with publisher confirms and ``mandatory``,
and the delivery of outcome messages in batches. Every aio-pika/aiormq error
is translated here into ``PublishError``s (``raise ... from exc``); nothing
above this module sees a driver type.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import aio_pika
import aiormq
import aiormq.exceptions
import structlog
from aiormq.abc import ChannelFrame
from pamqp.body import ContentBody
from pamqp.commands import Basic
from pamqp.frame import marshal
from pamqp.header import ContentHeader

from pacerd.config import ready_queue_name as ready_queue_name  # re-exported: config names queues
from pacerd.errors import BrokerUnavailable, PublishError, PublishRejected, PublishTimeout

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence

    from aio_pika.abc import AbstractChannel, AbstractRobustConnection

    from pacerd.models import ClaimedJob

log = structlog.get_logger("pacerd.publisher")

READY_EXCHANGE = "pacerd.ready"
OUTCOMES_EXCHANGE = "pacerd.outcomes"
OUTCOMES_QUEUE = "pacerd.outcomes"
INVALID_QUEUE = "pacerd.outcomes.invalid"


def message_id(job_id: str, attempt: int) -> str:
    return f"{job_id}:{attempt}"


def ready_body(job: ClaimedJob) -> bytes:
    """The ready message (docs/protocol.md). Payload and cursor arrive from the
    ledger as JSON text and are spliced in without a decode/encode round."""
    cursor = job.cursor_json if job.cursor_json is not None else "null"
    return (
        f'{{"job_id":{json.dumps(job.job_id)},"kind":{json.dumps(job.kind)},'
        f'"destination":{json.dumps(job.destination)},"attempt":{job.attempt},'
        f'"revision":{job.revision},"payload":{job.payload_json},"cursor":{cursor},'
        f'"eligible_at":"{job.eligible_at.isoformat()}"}}'
    ).encode()


class Publisher(Protocol):
    """What admission needs from the broker (fakes implement it in tests)."""

    async def declare_destination(self, destination: str, queue: str) -> None:
        """Declares ``queue`` bound with routing key ``destination`` (a
        destination's name, or its group's)."""
        ...

    async def publish(self, job: ClaimedJob, headers: Mapping[str, str]) -> None:
        """Returns once the broker confirmed the message; raises
        PublishRejected (nack or unroutable), PublishTimeout or BrokerUnavailable."""
        ...

    async def publish_many(
        self, jobs: Sequence[ClaimedJob], headers: Sequence[Mapping[str, str]]
    ) -> list[PublishError | None]:
        """Publishes ``jobs`` with their confirms pipelined; returns, in order,
        None for each confirmed message and the error ``publish`` would have
        raised for each other one. Raises nothing but cancellation."""
        ...


def _properties(job: ClaimedJob, headers: Mapping[str, str]) -> aiormq.spec.Basic.Properties:
    return aiormq.spec.Basic.Properties(
        content_type="application/json",
        delivery_mode=2,
        message_id=message_id(job.job_id, job.attempt),
        correlation_id=job.job_id,
        headers=dict(headers),
    )


def _confirmed(result: object) -> None:
    if not isinstance(result, Basic.Ack):
        raise PublishRejected(f"the broker did not acknowledge the message: {result!r}")


def _translated(error: BaseException) -> PublishError:
    """The PublishError that ``translate_errors`` makes of a driver error."""
    try:
        with translate_errors():
            raise error
    except PublishError as translated:
        return translated
    except Exception:  # not a broker error: still this message's failure
        return PublishError(f"the publish failed: {error!r}")


def _outcome(confirm: asyncio.Future[Any], *, timed_out: bool) -> PublishError | None:
    """What became of one message of ``write_batch``: None once confirmed."""
    if timed_out:
        return PublishTimeout()
    if confirm.cancelled():
        return BrokerUnavailable("the broker channel closed during the publish")
    error = confirm.exception()
    if error is not None:
        return error if isinstance(error, PublishError) else _translated(error)
    try:
        _confirmed(confirm.result())
    except PublishRejected as rejected:
        return rejected
    return None


def _forget_message_id(ids: dict[str, int], message_id: str, tag: int, _: object) -> None:
    if ids.get(message_id) == tag:
        del ids[message_id]


async def write_batch(
    channel: Any,
    messages: Sequence[tuple[str, str, bytes, aiormq.spec.Basic.Properties]],
) -> list[asyncio.Future[Any]]:
    """Writes ``(exchange, routing key, body, properties)`` messages, each
    published ``mandatory`` on the confirming aiormq ``channel``, as one frame
    buffer — one socket write, where aiormq's ``basic_publish`` makes one per
    message (with a lock, a timeout scope and, pipelined, a task each: most of
    the daemon's CPU at full speed) — and returns each message's confirmation
    future (the publish method frame is marshalled once per route). The
    futures are aiormq's own, in its table: the channel settles
    them as it settles ``basic_publish``'s (an ack, a nack, the return of an
    unroutable message matched by ``message_id``, the channel's close). It
    needs aiormq 7.2's channel attributes (the version is pinned in
    pyproject.toml, and ``tests/integration/test_publish_batch.py`` holds
    each case to the broker). Cancelled before the write, it gives the
    delivery tags back."""
    if not channel.publisher_confirms:
        raise ValueError("write_batch needs a channel in confirm mode")
    parts: list[bytes] = []
    confirms: list[asyncio.Future[Any]] = []
    size, number = channel.max_content_size, channel.number
    publish_frames: dict[tuple[str, str], bytes] = {}  # the same for every message of a route
    async with channel.lock:
        first_tag = channel.delivery_tag + 1
        ids: dict[str, int] = channel.message_id_delivery_tag
        for exchange, routing_key, body, properties in messages:
            publish = publish_frames.get((exchange, routing_key))
            if publish is None:
                method = Basic.Publish(exchange=exchange, routing_key=routing_key, mandatory=True)
                publish = publish_frames[exchange, routing_key] = marshal(method, number)
            channel.delivery_tag += 1
            tag = channel.delivery_tag
            confirm = channel.create_future()
            channel.confirmations[tag] = confirm
            if properties.message_id:
                ids[properties.message_id] = tag
                confirm.add_done_callback(
                    functools.partial(_forget_message_id, ids, properties.message_id, tag)
                )
            confirms.append(confirm)
            parts.append(publish)
            parts.append(marshal(ContentHeader(properties=properties, body_size=len(body)), number))
            parts.extend(
                marshal(ContentBody(body[i : i + size]), number) for i in range(0, len(body), size)
            )
        try:
            await channel.write_queue.put(ChannelFrame(payload=b"".join(parts), should_close=False))
        except BaseException:
            for tag in range(first_tag, channel.delivery_tag + 1):
                channel.confirmations.pop(tag, None)
            channel.delivery_tag = first_tag - 1
            for confirm in confirms:
                confirm.cancel()
            raise
    return confirms


async def _settle_confirm_frame(channel: Any, frame: Any) -> None:
    """A confirming channel's handler of the broker's acks and nacks, each
    message settled once, as the frame is read (``confirming_channel``).

    aiormq 7.2's own handler schedules, for an ack with ``multiple`` set,
    one settling call for every delivery tag up to the frame's still in its
    table, and its table keeps them until those calls run: the several acks
    of one read of the socket (the broker acknowledges a batch of publishes
    in steps) schedule the same tags again and again. With thousands of
    messages a second that was three calls for each message, and the
    publishing process's largest single cost.

    The table is ordered by delivery tag (publishes insert under the
    channel's lock, in tag order; the only entry added out of order is
    the placeholder of a returned message, which no one awaits), so the tags
    an ack covers are the table's first ones, up to the first tag past it.
    Each is settled by aiormq's own ``_confirm_delivery`` (an ack, a nack,
    a return, a future already cancelled), exactly as its handler would."""
    confirmations = channel.confirmations
    tag = frame.delivery_tag
    if tag not in confirmations:
        log.warning("unexpected_confirm", delivery_tag=tag)
        return
    if not getattr(frame, "multiple", False):
        channel._confirm_delivery(tag, frame)
        return
    covered = list(itertools.takewhile(lambda t: t <= tag, confirmations))
    for each in covered:
        channel._confirm_delivery(each, frame)


async def confirming_channel(channel: AbstractChannel) -> aiormq.abc.AbstractChannel:
    """The aiormq channel under ``channel`` (opened with publisher confirms),
    its acks and nacks settled by ``_settle_confirm_frame``: what
    ``write_batch`` publishes on, in the daemon and in the worker library."""
    underlay = await channel.get_underlay_channel()
    # aiormq's reader looks its handler up on the channel for every frame
    underlay._on_confirm_frame = functools.partial(_settle_confirm_frame, underlay)  # type: ignore[attr-defined]
    return underlay


@contextlib.contextmanager
def translate_errors() -> Iterator[None]:
    try:
        yield
    except aiormq.exceptions.PublishError as exc:
        raise PublishRejected(f"unroutable: no queue is bound for it ({exc})") from exc
    except aiormq.exceptions.DeliveryError as exc:
        raise PublishRejected(f"the broker refused the message ({exc})") from exc
    except TimeoutError as exc:
        raise PublishTimeout() from exc
    except aiormq.exceptions.ChannelPreconditionFailed as exc:
        raise PublishError(f"the broker refused a declaration: {exc}") from exc
    except (
        aiormq.exceptions.AMQPError,
        aiormq.exceptions.ChannelInvalidStateError,
        ConnectionError,
        OSError,
        RuntimeError,
        # aiormq's frame reader ends with this when the socket closes during
        # the handshake (a proxy or broker that accepts, then drops)
        StopAsyncIteration,
    ) as exc:
        raise BrokerUnavailable(f"the broker cannot be reached: {exc!r}") from exc


@dataclass(slots=True)
class Delivery:
    """One incoming message, acknowledged through its batch."""

    body: bytes
    message_id: str | None
    headers: dict[str, Any]
    delivery_tag: int


@dataclass(slots=True)
class Broker:
    """One AMQP connection: a confirming channel for ready work and one for
    outcomes. Not robust by design: on loss, callers see BrokerUnavailable,
    release what they hold, and call ``connect()`` again with backoff."""

    url: str
    queue_type: str = "quorum"
    publish_timeout_seconds: float = 10.0
    declare_queues: bool = True
    name: str = "pacerd"
    _connection: AbstractRobustConnection | None = None
    _channel: AbstractChannel | None = None
    # The aiormq channel under ``_channel``, looked up once per connection
    # rather than once per message (publishing goes straight to it).
    _underlay: aiormq.abc.AbstractChannel | None = None
    _declared: set[tuple[str, str]] = field(default_factory=set)  # (queue, routing key)
    on_close: Callable[[], None] | None = None
    # destination -> routing key (``Config.route_for``); None: the destination itself
    route: Callable[[str], str] | None = None
    declarations: int = 0  # queues declared and bound over this Broker's life

    @property
    def connected(self) -> bool:
        return (
            self._connection is not None
            and not self._connection.is_closed
            and self._channel is not None
            and not self._channel.is_closed
        )

    async def connect(self) -> None:
        await self.close()
        with translate_errors():
            self._connection = await aio_pika.connect(  # type: ignore[assignment]
                self.url, timeout=10, client_properties={"connection_name": self.name}
            )
            assert self._connection is not None
            self._channel = await self._connection.channel(
                publisher_confirms=True, on_return_raises=True
            )
            await self._declare_core(self._channel)
            self._underlay = await confirming_channel(self._channel)
        self._declared.clear()

    async def close(self) -> None:
        connection, self._connection, self._channel = self._connection, None, None
        self._underlay = None
        if connection is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(connection.close(), 5)

    def _queue_arguments(self) -> dict[str, Any]:
        return {"x-queue-type": self.queue_type}

    async def _declare_core(self, channel: AbstractChannel) -> None:
        ready = await channel.declare_exchange(
            READY_EXCHANGE, aio_pika.ExchangeType.DIRECT, durable=True
        )
        outcomes = await channel.declare_exchange(
            OUTCOMES_EXCHANGE, aio_pika.ExchangeType.FANOUT, durable=True
        )
        del ready
        queue = await channel.declare_queue(
            OUTCOMES_QUEUE, durable=True, arguments=self._queue_arguments()
        )
        await queue.bind(outcomes, routing_key="")
        await channel.declare_queue(INVALID_QUEUE, durable=True, arguments=self._queue_arguments())

    async def declare_destination(self, destination: str, queue: str) -> None:
        """Declares ``queue`` and binds it with routing key ``destination`` (a
        destination's name, or its group's), once per connection."""
        if not self.declare_queues or (queue, destination) in self._declared:
            return
        channel = self._require_channel()
        with translate_errors():
            declared = await channel.declare_queue(
                queue, durable=True, arguments=self._queue_arguments()
            )
            await declared.bind(READY_EXCHANGE, routing_key=destination)
        self._declared.add((queue, destination))
        self.declarations += 1

    def routing_key(self, destination: str) -> str:
        return destination if self.route is None else self.route(destination)

    def _require_channel(self) -> AbstractChannel:
        if self._channel is None or self._channel.is_closed:
            raise BrokerUnavailable("not connected to the broker")
        return self._channel

    async def _require_underlay(self) -> aiormq.abc.AbstractChannel:
        channel = self._require_channel()
        underlay = self._underlay
        if underlay is None or underlay.is_closed:
            with translate_errors():
                underlay = self._underlay = await confirming_channel(channel)
        return underlay

    async def publish(self, job: ClaimedJob, headers: Mapping[str, str]) -> None:
        underlay = await self._require_underlay()
        with translate_errors():
            result = await underlay.basic_publish(
                ready_body(job),
                exchange=READY_EXCHANGE,
                routing_key=self.routing_key(job.destination),
                properties=_properties(job, headers),
                mandatory=True,
                timeout=self.publish_timeout_seconds,
            )
        _confirmed(result)

    async def publish_many(
        self, jobs: Sequence[ClaimedJob], headers: Sequence[Mapping[str, str]]
    ) -> list[PublishError | None]:
        """Publishes ``jobs`` (``headers[i]`` for ``jobs[i]``) with their confirms
        pipelined: every message is written — in one socket write — before the
        first confirm is awaited, and all of them share one
        ``publish_timeout_seconds``. Returns, in order, None for each confirmed
        message and the ``PublishError`` of each other one (as ``publish``
        would raise it); raises nothing but cancellation."""
        if not jobs:
            return []
        written = await self.write_many(jobs, headers)
        if isinstance(written, PublishError):
            return [written] * len(jobs)
        return await self.settle(written)

    async def write_many(
        self, jobs: Sequence[ClaimedJob], headers: Sequence[Mapping[str, str]]
    ) -> list[asyncio.Future[Any]] | PublishError:
        """The first half of ``publish_many``: writes ``jobs`` (``write_batch``)
        and returns each one's confirmation future, or the ``PublishError``
        that failed them all."""
        keys = {d: self.routing_key(d) for d in {job.destination for job in jobs}}
        try:
            underlay = await self._require_underlay()
            with translate_errors():
                return await write_batch(
                    underlay,
                    [
                        (
                            READY_EXCHANGE,
                            keys[job.destination],
                            ready_body(job),
                            _properties(job, job_headers),
                        )
                        for job, job_headers in zip(jobs, headers, strict=True)
                    ],
                )
        except PublishError as exc:
            return exc

    async def settle(self, confirms: Sequence[asyncio.Future[Any]]) -> list[PublishError | None]:
        """The second half of ``publish_many``: awaits ``confirms`` within one
        ``publish_timeout_seconds``; cancelled, it cancels them (the broker's
        confirms, if any, are ignored)."""
        try:
            _done, pending = await asyncio.wait(confirms, timeout=self.publish_timeout_seconds)
        except BaseException:
            for confirm in confirms:
                confirm.cancel()
            raise
        for confirm in pending:
            confirm.cancel()
        return [_outcome(confirm, timed_out=confirm in pending) for confirm in confirms]

    async def publish_raw(
        self,
        routing_key: str,
        body: bytes,
        *,
        headers: Mapping[str, Any] | None = None,
        exchange: str = "",
    ) -> None:
        """Publishes any message with confirms (parking invalid outcomes, tests)."""
        underlay = await self._require_underlay()
        with translate_errors():
            await underlay.basic_publish(
                body,
                exchange=exchange,
                routing_key=routing_key,
                properties=aiormq.spec.Basic.Properties(
                    delivery_mode=2, headers=dict(headers or {})
                ),
                mandatory=True,
                timeout=self.publish_timeout_seconds,
            )

    @contextlib.asynccontextmanager
    async def consume(self, queue: str, *, prefetch: int) -> AsyncIterator[DeliveryBatches]:
        """Consumes ``queue`` on a channel of its own; yields a batch source.

        Deliveries are taken from aiormq directly (aio-pika would wrap each in
        an ``IncomingMessage`` and a task of its own: a tenth of the daemon's
        CPU at full speed) and acknowledged by delivery tag."""
        if self._connection is None or self._connection.is_closed:
            raise BrokerUnavailable("not connected to the broker")
        with translate_errors():
            channel = await self._connection.channel(publisher_confirms=False)
            underlay = await channel.get_underlay_channel()
            await underlay.basic_qos(prefetch_count=prefetch)
        batches = DeliveryBatches(underlay, max_batch=prefetch)
        # A closed channel or connection, or the broker cancelling the consumer
        # (its queue deleted), ends the batches (BrokerUnavailable) instead of
        # leaving the consumer waiting forever.
        channel.close_callbacks.add(batches.close)
        self._connection.close_callbacks.add(batches.close)
        underlay.on_consumer_cancel_callbacks.add(batches.close)
        with translate_errors():
            ok = await underlay.basic_consume(queue, batches.put)
        try:
            yield batches
        finally:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(underlay.basic_cancel(ok.consumer_tag or ""), 2)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(channel.close(), 2)


class DeliveryBatches:
    """Incoming messages grouped in batches (everything already buffered, up
    to ``max_batch``), so the consumer applies them in one transaction and
    acknowledges them with one frame."""

    def __init__(self, channel: aiormq.abc.AbstractChannel, *, max_batch: int) -> None:
        self._channel = channel
        self._queue: asyncio.Queue[aiormq.abc.DeliveredMessage | None] = asyncio.Queue()
        self.max_batch = max_batch
        self.closed = False

    async def put(self, message: aiormq.abc.DeliveredMessage) -> None:
        self._queue.put_nowait(message)

    def close(self, *_args: object) -> None:
        if not self.closed:
            self.closed = True
            self._queue.put_nowait(None)

    async def next_batch(self) -> list[Delivery]:
        first = await self._queue.get()
        if first is None:
            self._queue.put_nowait(None)
            raise BrokerUnavailable("the outcome channel was closed")
        messages = [first]
        while len(messages) < self.max_batch and not self._queue.empty():
            message = self._queue.get_nowait()
            if message is None:
                self._queue.put_nowait(None)
                break
            messages.append(message)
        return [
            Delivery(
                body=m.body,
                message_id=m.header.properties.message_id,
                headers=dict(m.header.properties.headers or {}),
                delivery_tag=m.delivery_tag or 0,
            )
            for m in messages
        ]

    async def ack(self, deliveries: Sequence[Delivery]) -> None:
        """Acknowledges every delivery of a batch (one frame: ``multiple``)."""
        if not deliveries:
            return
        with translate_errors():
            await self._channel.basic_ack(max(d.delivery_tag for d in deliveries), multiple=True)

    async def requeue(self, deliveries: Sequence[Delivery]) -> None:
        with translate_errors():
            for d in deliveries:
                await self._channel.basic_nack(d.delivery_tag, requeue=True)
