"""The worker side of the protocol: a small library for Python workers.

Owns what a worker process does with an offer (docs/protocol.md, "Messages"): consume
``pacerd.ready.<destination>`` or a group's shared queue with a bounded prefetch,
decode the envelope and validate it against ``schemas/ready.schema.json``, optionally ask
``pacerd.is_current`` before the costly call (one statement for the offers that
arrive together: ``pacerd.currency``), run the registered handler, turn
what it did into an outcome (return → ok with the returned mapping as
``detail``; ``Refused`` → refused; ``Retry`` or any other exception → retry;
``Fail`` → fail; ``Continue`` → continue), publish the outcome with publisher
confirms, and acknowledge the delivery only after that confirm. Outcomes are
written in batches as they are ready (one socket write for many), their
confirms pipelined, and the deliveries whose outcomes are confirmed are
acknowledged together, never one before its own outcome's confirm and never
held back by a slower handler; the handlers running at once are bounded by the
prefetch. Each offer gets a consumer span continuing the trace of its
``traceparent``; with no span exporter configured (``pacerd worker`` under
``OTEL_TRACES_EXPORTER=none``, or a ``Worker`` given a ``NoOpTracer``) no span
is made and the offer's ``traceparent`` is passed on to its outcome. On stop it
cancels its consumers, gives in-flight handlers a grace period and abandons the
rest unacknowledged: the broker returns them to the queue. It must not write
the ledger: outcomes reach pacerd only as messages (``pacerd.is_current`` is
its one, read-only, query). A malformed envelope never stops it. What the
handlers share (an HTTP client) is opened by the app's ``lifespan`` before the
worker first consumes and closed once it has stopped.

    @contextlib.asynccontextmanager
    async def lifespan() -> AsyncIterator[None]:
        async with aiohttp.ClientSession() as shared.client:
            yield

    app = WorkerApp(destinations=["llm"], prefetch=16, lifespan=lifespan)

    @app.handler("summarize")
    async def summarize(job: Job) -> dict[str, object]:
        ...  # call the upstream with job.idempotency_key
        return {"tokens": 812}

    $ pacerd worker --app mymodule:app -c pacerd.toml
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib
import math
import signal
import sys
from collections.abc import Awaitable, Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

import aio_pika
import aiormq
import anyio
import structlog
from aiormq.abc import ChannelFrame
from opentelemetry import trace
from opentelemetry.trace import SpanKind
from pamqp.commands import Basic
from pamqp.frame import marshal

from pacerd import heap
from pacerd.clock import Clock, SystemClock
from pacerd.config import instance_name
from pacerd.currency import CurrentCheck
from pacerd.errors import BrokerUnavailable, ConfigError, PacerdError
from pacerd.models import Outcome, Report
from pacerd.protocol import (
    Continue,
    Fail,
    InvalidEnvelope,
    Job,
    Refused,
    Retry,
    decode_ready,
    load_schema,
    outcome_body,
    to_report,
)
from pacerd.publisher import (
    INVALID_QUEUE,
    OUTCOMES_EXCHANGE,
    Broker,
    _outcome,
    confirming_channel,
    message_id,
    ready_queue_name,
    write_batch,
)
from pacerd.publisher import translate_errors as broker_errors
from pacerd.telemetry import extract_context, inject_traceparent, setup_telemetry

if TYPE_CHECKING:
    from aio_pika.abc import AbstractConnection
    from anyio.abc import TaskStatus

    from pacerd.config import Config

__all__ = [
    "Continue", "Fail", "InvalidEnvelope", "Job", "Outgoing", "Refused", "Retry", "Worker",
    "WorkerApp", "WorkerStats", "acknowledgements", "decode_ready", "load_app", "load_schema",
    "main", "outcome_body", "to_report",
]  # fmt: skip

log = structlog.get_logger("pacerd.worker")
SPAN_PROCESS = "pacerd.worker.process"
EX_OK, EX_FAILURE, EX_USAGE = 0, 1, 2
# A redelivered offer may have been reported already: the worker that held it
# can die after its outcome was confirmed and before its acknowledgement. Its
# ``pacerd.is_current`` check waits this long, so that pacerd applies that
# outcome first (it does within tens of milliseconds) and a completed job is
# not called again; checked at once, it raced the outcome and lost now and
# then (a call repeated under its idempotency key).
REDELIVERED_CHECK_DELAY_SECONDS = 1.0


Handler = Callable[[Job], Awaitable[object]]
Lifespan = Callable[[], contextlib.AbstractAsyncContextManager[object]]
H = TypeVar("H", bound=Handler)


class WorkerApp:
    """The handlers of one worker program, and how its worker runs them.

    ``prefetch`` bounds the unacknowledged offers per queue (so the
    handlers running at once); ``handler_timeout_seconds`` is each handler's
    ``job.deadline``, after which it is cancelled and reported ``retry``.
    ``groups`` names ``[groups.NAME]`` whose shared queues it consumes too (a
    grouped destination's offers are there; the handler gets ``job.destination``).
    ``lifespan`` makes an async context manager that a worker enters before it
    first consumes and leaves once it has stopped: open what the handlers share
    (an HTTP client, a connection pool) there.
    """

    def __init__(
        self, *, destinations: Iterable[str] = (), prefetch: int = 16, check_current: bool = True,
        shutdown_grace_seconds: float = 10.0, handler_timeout_seconds: float | None = 240.0,
        groups: Iterable[str] = (), lifespan: Lifespan | None = None,
    ) -> None:  # fmt: skip
        if prefetch < 1 or shutdown_grace_seconds < 0:
            raise ValueError("prefetch must be >= 1 and shutdown_grace_seconds >= 0")
        if handler_timeout_seconds is not None and handler_timeout_seconds <= 0:
            raise ValueError("handler_timeout_seconds must be > 0 (or None)")
        self.prefetch, self.check_current = prefetch, check_current
        self.shutdown_grace_seconds = shutdown_grace_seconds
        self.handler_timeout_seconds = handler_timeout_seconds
        self._destinations = list(dict.fromkeys(destinations))
        self.groups = tuple(dict.fromkeys(groups))
        self.lifespan = lifespan
        self._handlers: dict[tuple[str | None, str | None], Handler] = {}
        self._resolved: dict[tuple[str, str], Handler | None] = {}  # handler_for's answers

    @property
    def destinations(self) -> tuple[str, ...]:
        return tuple(self._destinations)

    def handler(
        self, kind: str | None = None, *, destination: str | None = None
    ) -> Callable[[H], H]:
        """Registers an async handler for a kind, a destination, both, or (neither) any job."""

        def register(fn: H) -> H:
            if (kind, destination) in self._handlers:
                raise ValueError(f"a handler is already registered for {(kind, destination)}")
            self._handlers[(kind, destination)] = fn
            self._resolved.clear()
            if destination is not None and destination not in self._destinations:
                self._destinations.append(destination)
            return fn

        return register

    def handler_for(self, kind: str, destination: str) -> Handler | None:
        """The most specific handler: kind and destination, kind, destination, any."""
        try:
            return self._resolved[kind, destination]
        except KeyError:
            pass
        found = None
        for key in ((kind, destination), (kind, None), (None, destination), (None, None)):
            if (found := self._handlers.get(key)) is not None:
                break
        self._resolved[kind, destination] = found
        return found


@dataclass(slots=True)
class WorkerStats:
    """Counters of one ``Worker`` (tests and logs read them)."""

    received: int = 0
    inflight: int = 0  # received, not yet acknowledged (handler running or outcome unconfirmed)
    outcomes: dict[str, int] = field(default_factory=dict)  # reported and confirmed, by outcome
    skipped: int = 0  # not current: acknowledged without running the handler
    parked: int = 0  # unreportable envelopes moved to pacerd.outcomes.invalid
    publish_failures: int = 0  # outcome publishes nacked or timed out (retried)
    abandoned: int = 0  # handlers cancelled at shutdown, left unacknowledged

    @property
    def reported(self) -> int:
        return sum(self.outcomes.values())


class Outgoing(NamedTuple):
    """What one offer's processing publishes: its outcome (``outcome`` set)
    or, for an envelope that names no attempt, the envelope itself parked in
    ``pacerd.outcomes.invalid`` (``outcome`` None)."""

    exchange: str
    routing_key: str
    body: bytes
    properties: aiormq.spec.Basic.Properties
    outcome: str | None


@dataclass(slots=True, eq=False)
class _Pending:
    """One outcome on its way: the delivery it settles, and its retries."""

    tag: int
    out: Outgoing
    backoff: float = 0.2
    timed_out: bool = False
    batch: _Batch | None = None  # the write it went out in


@dataclass(slots=True, eq=False)
class _Batch:
    """One write of outcomes, until the broker has answered for each."""

    unanswered: int
    expiry: asyncio.TimerHandle | None = None


# Writes of outcomes whose confirms are awaited at once: while they are, the
# outcomes that become ready gather for the next write, so the batches grow
# with the broker's round trip (a busier broker, bigger batches).
BATCHES_IN_FLIGHT = 2


def acknowledgements(
    settled: Sequence[int], unsettled: Collection[int]
) -> tuple[int | None, list[int]]:
    """The acks that settle ``settled`` (delivery tags whose outcomes are
    confirmed) while ``unsettled`` (every other tag delivered on the channel
    and neither acknowledged nor requeued) stay unacknowledged: one
    ``multiple`` ack up to the highest settled tag below the lowest unsettled
    one (None when there is none) — it acknowledges every lower tag, and those
    are all settled or acknowledged already — and an individual ack for each
    settled tag above it."""
    lowest = min(unsettled, default=math.inf)
    below = [t for t in settled if t < lowest]
    return (max(below) if below else None), [t for t in settled if t > lowest]


class _Session:
    """The acknowledgement bookkeeping of one connection.

    Outcomes are written in batches (``write_batch``: one socket write for
    all those ready), their confirms pipelined; each delivery is settled only
    once its outcome is confirmed, and settled deliveries are acknowledged in
    one write: one ``multiple`` ack up to the lowest delivery still
    unsettled, and an individual ack for each settled one above it, so that
    neither an unconfirmed outcome is ever acknowledged nor a slow handler
    holds back the acknowledgement of the others."""

    def __init__(
        self,
        worker: Worker,
        consume: aiormq.abc.AbstractChannel,
        publish: aiormq.abc.AbstractChannel,
        lost: anyio.Event,
    ) -> None:
        self.worker, self.consume, self.publish, self.lost = worker, consume, publish, lost
        self.unsettled: set[int] = set()  # delivered, neither acknowledged nor requeued
        # to acknowledge, with what to count once they are: the outcome, None
        # for an envelope parked, "" for an offer skipped
        self.settled: list[tuple[int, str | None]] = []
        self.requeue: list[int] = []  # to hand back (received while draining)
        self.outbox: list[_Pending] = []
        self.handling: set[asyncio.Task[Any]] = set()
        self.draining = False
        self.written: asyncio.Future[Any] | None = None  # the last acknowledgement write
        self._wake, self._idle = asyncio.Event(), asyncio.Event()
        self._in_flight = 0  # writes of outcomes not yet answered for
        self._write_queue: asyncio.Queue[ChannelFrame] = consume.write_queue  # type: ignore[attr-defined]
        self._loop = asyncio.get_running_loop()

    def send(self, pending: _Pending) -> None:
        self.outbox.append(pending)
        self._wake.set()

    def settle(self, tag: int, counted: str | None) -> None:
        self.settled.append((tag, counted))
        self._wake.set()

    def hand_back(self, tag: int) -> None:
        self.requeue.append(tag)
        self._wake.set()

    async def pump(self) -> None:
        """Writes what is ready, as it becomes ready, until cancelled."""
        while True:
            await self._wake.wait()
            await asyncio.sleep(0)  # the handlers that are ready finish first: one write for all
            self._wake.clear()
            if self.outbox and self._in_flight < BATCHES_IN_FLIGHT:
                await self._write_outcomes()
            if self.settled or self.requeue:
                await self._write_acks()
            self._idle.set()

    async def _write_outcomes(self) -> None:
        batch, self.outbox = self.outbox, []
        with broker_errors():
            confirms = await write_batch(self.publish, [p.out[:4] for p in batch])
        written = _Batch(len(batch))
        self._in_flight += 1
        for pending, confirm in zip(batch, confirms, strict=True):
            pending.batch = written
            confirm.add_done_callback(partial(self._confirmed, pending))
        timeout = self.worker.publish_timeout_seconds
        written.expiry = self._loop.call_later(timeout, self._expire, batch, confirms)

    def _expire(self, batch: list[_Pending], confirms: list[asyncio.Future[Any]]) -> None:
        for pending, confirm in zip(batch, confirms, strict=True):
            if not confirm.done():
                pending.timed_out = True
                confirm.cancel()

    def _confirmed(self, pending: _Pending, confirm: asyncio.Future[Any]) -> None:
        written = pending.batch
        if written is not None:
            written.unanswered -= 1
            if not written.unanswered:  # the broker answered for the whole write
                self._in_flight -= 1
                if written.expiry is not None:
                    written.expiry.cancel()
                if self.outbox:
                    self._wake.set()
        error = _outcome(confirm, timed_out=pending.timed_out)
        if error is None:
            self.settle(pending.tag, pending.out.outcome)
            return
        elif isinstance(error, BrokerUnavailable):
            if not self.lost.is_set():
                log.warning("outcome_publish_interrupted", error=str(error))
                self.lost.set()
            return
        else:  # nacked, returned or timed out: published again after a backoff
            self.worker.stats.publish_failures += 1
            log.warning("outcome_publish_failed", error=str(error), retry_in=pending.backoff)
            retry = _Pending(pending.tag, pending.out, min(pending.backoff * 2, 5.0))
            self._loop.call_later(pending.backoff, self.send, retry)
        self.worker._notify()

    async def _write_acks(self) -> None:
        requeue, self.requeue = self.requeue, []
        settled, self.settled = self.settled, []
        unsettled = self.unsettled
        unsettled.difference_update(requeue)
        tags = [tag for tag, _ in settled]
        unsettled.difference_update(tags)
        frames: list[Any] = [Basic.Nack(delivery_tag=t, requeue=True) for t in requeue]
        up_to, each = acknowledgements(tags, unsettled)
        if up_to is not None:
            frames.append(Basic.Ack(delivery_tag=up_to, multiple=True))
        frames += [Basic.Ack(delivery_tag=t) for t in each]
        number = self.consume.number
        self.written = written = self._loop.create_future()
        with broker_errors():
            await self._write_queue.put(
                ChannelFrame(
                    payload=b"".join(marshal(f, number) for f in frames),
                    should_close=False,
                    drain_future=written,
                )
            )
        stats = self.worker.stats
        stats.inflight -= len(settled)
        outcomes = stats.outcomes
        for _, counted in settled:
            if counted is None:
                stats.parked += 1
            elif counted:
                outcomes[counted] = outcomes.get(counted, 0) + 1
            else:
                stats.skipped += 1
        self.worker._notify()

    async def flushed(self) -> None:
        """Returns once every acknowledgement decided so far is on the wire."""
        while self.settled or self.requeue or self._wake.is_set():
            self._idle.clear()
            await self._idle.wait()
        if self.written is not None:  # (cancelled if the connection closes first)
            await asyncio.wait([self.written])


class Worker:
    """Runs a ``WorkerApp``: one AMQP connection (a consuming channel and a
    confirming one for outcomes), reconnecting with backoff until stopped."""

    def __init__(
        self,
        app: WorkerApp,
        *,
        broker_url: str,
        queues: Mapping[str, str] | None = None,
        dsn: str | None = None,
        queue_type: str = "quorum",
        declare_queues: bool = True,
        publish_timeout_seconds: float = 10.0,
        handler_timeout_seconds: float | None = None,
        outcomes_exchange: str = OUTCOMES_EXCHANGE,
        clock: Clock | None = None,
        tracer: trace.Tracer | None = None,
        connection_name: str = "pacerd-worker",
    ) -> None:
        self.app, self.broker_url, self.dsn = app, broker_url, dsn
        self.connection_name = connection_name  # as the broker lists the connection
        # routing key -> queue (a destination's, or a group's shared one)
        self.queues = dict(
            queues or {d: ready_queue_name(d) for d in (*app.destinations, *app.groups)}
        )
        if not self.queues:
            raise ValueError("the app names no destination to consume")
        self.queue_type, self.declare_queues = queue_type, declare_queues
        self.publish_timeout_seconds = publish_timeout_seconds
        self.handler_timeout_seconds = handler_timeout_seconds or app.handler_timeout_seconds
        self.outcomes_exchange, self.clock = outcomes_exchange, clock or SystemClock()
        self.stats = WorkerStats()
        self.tracer = tracer or trace.get_tracer("pacerd.worker")
        self._stop, self._lost = anyio.Event(), anyio.Event()
        self._changed: anyio.Event | None = None  # only while someone waits
        self._started = False
        self.current_check = (
            CurrentCheck(dsn, self.clock) if app.check_current and dsn is not None else None
        )
        self._connection: AbstractConnection | None = None  # the current session's
        self._configures = True  # False once the broker refused a declaration

    @classmethod
    def from_config(cls, app: WorkerApp, cfg: Config) -> Worker:
        """From ``[database]`` and ``[broker]``; handler deadlines stay inside the offer lease."""
        lease_bound = 0.8 * cfg.leases.offer_seconds
        timeout = app.handler_timeout_seconds
        unknown = [g for g in app.groups if g not in cfg.groups]
        if unknown:
            why = "the worker app consumes this group, but the configuration has no such group"
            raise ConfigError([f"groups.{g}: {why}" for g in unknown])
        routes = [cfg.route_for(d) for d in app.destinations]
        routes += [cfg.route_for_group(g) for g in app.groups]
        return cls(
            app, broker_url=cfg.broker.url, dsn=cfg.database.dsn,
            queues={r.routing_key: r.queue for r in routes},
            queue_type=cfg.broker.queue_type, declare_queues=cfg.broker.declare_queues,
            publish_timeout_seconds=cfg.broker.publish_timeout_seconds,
            handler_timeout_seconds=lease_bound if timeout is None else min(timeout, lease_bound),
        )  # fmt: skip

    @property
    def stop_requested(self) -> bool:
        return self._stop.is_set()

    def request_stop(self) -> None:
        """Graceful stop: no new offers; in-flight handlers get the grace period."""
        self._stop.set()

    async def wait_until(self, predicate: Callable[[WorkerStats], bool]) -> None:
        """Returns once ``predicate(self.stats)`` holds (wrap it in ``fail_after``)."""
        while not predicate(self.stats):
            if self._changed is None:
                self._changed = anyio.Event()
            await self._changed.wait()

    def _notify(self) -> None:
        changed, self._changed = self._changed, None
        if changed is not None:
            changed.set()

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Consumes until ``request_stop()``; ``started()`` once it first consumes.
        The app's ``lifespan`` is entered first and left last."""
        backoff = 0.5
        async with contextlib.AsyncExitStack() as stack:
            if self.app.lifespan is not None:
                await stack.enter_async_context(self.app.lifespan())
            try:
                while not self._stop.is_set():
                    try:
                        await self._session(task_status)
                        backoff = 0.5
                    except PacerdError as exc:
                        log.warning("worker_broker_unavailable", error=str(exc), retry_in=backoff)
                        with anyio.move_on_after(backoff):
                            await self._stop.wait()
                        backoff = min(backoff * 2, 10.0)
            finally:
                if self.current_check is not None:
                    with anyio.CancelScope(shield=True), anyio.move_on_after(5):
                        await self.current_check.close()

    async def _declare(self) -> None:
        """The same topology as the daemon (``Broker``): idempotent, either may
        start first. A user that may not configure (the least-privilege worker
        of docs/security.md) declares nothing: the session's passive declares
        then check that the daemon did, and invalid offers are parked through
        ``pacerd.outcomes`` (the daemon moves them on to the invalid queue)."""
        broker = Broker(self.broker_url, self.queue_type, declare_queues=self.declare_queues)
        try:
            await broker.connect()
            for destination, queue in self.queues.items():
                await broker.declare_destination(destination, queue)
            self._configures = True
        except BrokerUnavailable as exc:
            if not isinstance(exc.__cause__, aiormq.exceptions.ChannelAccessRefused):
                raise
            if self._configures:
                log.info("worker_declares_nothing", reason=str(exc.__cause__))
            self._configures = False
        finally:
            await broker.close()

    async def _session(self, task_status: TaskStatus[None]) -> None:
        await self._declare()
        with broker_errors():
            connection = await aio_pika.connect(
                self.broker_url, timeout=10,
                client_properties={"connection_name": self.connection_name},
            )  # fmt: skip
        self._lost = lost = anyio.Event()
        connection.close_callbacks.add(lambda *_: lost.set())
        self._connection = connection
        session: _Session | None = None
        try:
            with broker_errors():
                outcomes = await connection.channel(publisher_confirms=True, on_return_raises=True)
                channel = await connection.channel(publisher_confirms=False)
                for each in (outcomes, channel):
                    each.close_callbacks.add(lambda *_: lost.set())
                publish = await confirming_channel(outcomes)
                consume = await channel.get_underlay_channel()
                if (
                    self.outcomes_exchange
                ):  # the daemon's topology is there (passive: no right needed)
                    await publish.exchange_declare(self.outcomes_exchange, passive=True)
                await consume.basic_qos(prefetch_count=self.app.prefetch)
                session = _Session(self, consume, publish, lost)
                consumers = []
                for destination, name in self.queues.items():
                    await consume.queue_declare(name, passive=True)
                    ok = await consume.basic_consume(
                        name, partial(self._on_delivery, session, destination)
                    )
                    consumers.append(ok.consumer_tag or "")
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._pump, session)
                if not self._started:
                    self._started = True
                    task_status.started()
                log.info("worker_started", queues=sorted(self.queues.values()))
                await _wait_any(self._stop, lost)
                if not lost.is_set():
                    await self._drain(session, consumers)
                tg.cancel_scope.cancel()
            if not self._stop.is_set():
                raise BrokerUnavailable("the broker connection was lost")
            log.info("worker_stopped", abandoned=self.stats.abandoned, **self.stats.outcomes)
        finally:
            if session is not None:
                for task in session.handling:  # abandoned: unacknowledged, redelivered
                    task.cancel()
                self.stats.inflight = 0
            with anyio.CancelScope(shield=True), anyio.move_on_after(5):
                await connection.close()  # whatever was not acknowledged goes back to the queue

    async def _pump(self, session: _Session) -> None:
        try:
            await session.pump()
        except PacerdError as exc:  # the broker went away: unacknowledged, redelivered
            log.warning("delivery_interrupted", error=str(exc))
            session.lost.set()

    async def _drain(self, session: _Session, consumers: list[str]) -> None:
        """Stop consuming; in-flight handlers get the grace period."""
        session.draining = True
        log.info("worker_stopping", inflight=self.stats.inflight)
        with anyio.move_on_after(5), contextlib.suppress(PacerdError), broker_errors():
            for tag in consumers:  # if it fails, closing the connection cancels them
                await session.consume.basic_cancel(tag)
        with anyio.move_on_after(self.app.shutdown_grace_seconds):
            await self.wait_until(lambda s: s.inflight == 0)
        self.stats.abandoned += self.stats.inflight
        with anyio.move_on_after(5), contextlib.suppress(PacerdError):
            await session.flushed()

    async def _on_delivery(
        self, session: _Session, destination: str, message: aiormq.abc.DeliveredMessage
    ) -> None:
        """One delivery, in the task the driver runs it in: the handler, then
        the outcome handed to the session (which acknowledges it once confirmed)."""
        tag = message.delivery_tag or 0
        session.unsettled.add(tag)  # before any await: in delivery order
        if session.draining:  # delivered after the stop, never started: hand it back at once
            session.hand_back(tag)
            return
        stats = self.stats
        stats.received += 1
        stats.inflight += 1
        self._notify()
        task = asyncio.current_task()
        if task is not None:
            session.handling.add(task)
        properties = message.header.properties
        try:
            out = await self.process(
                destination, message.body, message_id=properties.message_id,
                correlation_id=properties.correlation_id, headers=properties.headers,
                content_type=properties.content_type, redelivered=bool(message.redelivered),
            )  # fmt: skip
        except Exception as exc:  # a bug of ours: a new session, and the offer is redelivered
            log.error("delivery_failed", message_id=properties.message_id, exc_info=exc)
            session.lost.set()
            return
        finally:
            if task is not None:
                session.handling.discard(task)
        if out is None:
            session.settle(tag, "")
        else:
            session.send(_Pending(tag, out))

    async def process(
        self,
        destination: str,
        body: bytes,
        *,
        message_id: str | None = None,
        correlation_id: str | None = None,
        headers: Mapping[str, Any] | None = None,
        content_type: str | None = "application/json",
        redelivered: bool = False,
    ) -> Outgoing | None:
        """One offer, from its body and properties to what to publish for it:
        its outcome, or the envelope parked; None when the offer is no longer
        current (acknowledged without running the handler). No I/O but the
        handler's and ``pacerd.is_current`` (``redelivered``: asked
        ``REDELIVERED_CHECK_DELAY_SECONDS`` later)."""
        try:
            job = decode_ready(
                body, clock=self.clock, message_id=message_id, correlation_id=correlation_id
            )
        except InvalidEnvelope as exc:
            return self._invalid(destination, body, exc, message_id, headers, content_type)
        if isinstance(self.tracer, trace.NoOpTracer):  # no spans: the offer's context goes on
            if not await self._is_current(job, redelivered=redelivered):
                log.info("offer_not_current", job_id=job.job_id, attempt=job.attempt)
                return None
            return self._outcome_message(await self._run_handler(job), _trace_headers(headers))
        attributes: dict[str, str | int] = {
            "messaging.system": "rabbitmq", "messaging.operation.type": "process",
            "messaging.destination.name": self.queues[destination],
            "messaging.message.id": message_id or "",
            "messaging.message.conversation_id": job.job_id, "pacerd.job_id": job.job_id,
            "pacerd.attempt": job.attempt, "pacerd.kind": job.kind,
            "pacerd.destination": job.destination,
        }  # fmt: skip
        with self.tracer.start_as_current_span(
            SPAN_PROCESS, context=extract_context(dict(headers or {})), kind=SpanKind.CONSUMER,
            attributes=attributes,
        ) as span:  # fmt: skip
            if not await self._is_current(job, redelivered=redelivered):
                log.info("offer_not_current", job_id=job.job_id, attempt=job.attempt)
                return None
            report = await self._run_handler(job)
            span.set_attribute("pacerd.outcome", str(report.outcome))
            return self._outcome_message(report, dict(inject_traceparent({})))

    async def _run_handler(self, job: Job) -> Report:
        handler = self.app.handler_for(job.kind, job.destination)
        if handler is None:
            error = f"no handler registered for kind {job.kind!r} (destination {job.destination!r})"
            return Report(job_id=job.job_id, attempt=job.attempt, outcome=Outcome.FAIL, error=error)
        timeout = self.handler_timeout_seconds
        if timeout is not None:
            # the Job was just decoded, nobody else holds it yet: set it as
            # dataclasses.replace would, without copying every field
            object.__setattr__(job, "deadline", self.clock.monotonic() + timeout)
        result: object = None
        raised: Exception | None = None
        try:
            async with asyncio.timeout(timeout):
                try:
                    result = await handler(job)
                except (Refused, Retry, Fail, Continue) as exc:
                    raised = exc
                except Exception as exc:  # any other error is the handler's: reported as retry
                    log.warning(
                        "handler_error", job_id=job.job_id, attempt=job.attempt, exc_info=exc
                    )
                    raised = exc
        except TimeoutError:  # the deadline cancelled the handler
            raised = Retry(
                f"the handler ran past its deadline ({timeout} s); to checkpoint a long job,"
                " raise Continue(cursor) before job.deadline"
            )
        return to_report(job.job_id, job.attempt, result=result, raised=raised)

    def _outcome_message(self, report: Report, headers: dict[str, Any]) -> Outgoing:
        try:
            body = outcome_body(report)
        except (TypeError, ValueError) as exc:  # the work is done: keep the ok, drop the detail
            detail = {"detail_error": f"the handler's result is not JSON: {exc}"}
            body = outcome_body(dataclasses.replace(report, detail=detail))
        properties = aiormq.spec.Basic.Properties(
            content_type="application/json", delivery_mode=2,
            message_id=message_id(report.job_id, report.attempt), correlation_id=report.job_id,
            headers=headers,
        )  # fmt: skip
        if self.outcomes_exchange:
            return Outgoing(self.outcomes_exchange, "", body, properties, str(report.outcome))
        return Outgoing("", OUTCOMES_EXCHANGE, body, properties, str(report.outcome))

    def _invalid(
        self,
        destination: str,
        body: bytes,
        exc: InvalidEnvelope,
        offer_message_id: str | None,
        headers: Mapping[str, Any] | None,
        content_type: str | None,
    ) -> Outgoing:
        """Reports ``fail`` when the envelope names an attempt (in its body or,
        when the body cannot say, in its ``message_id``/``correlation_id``):
        that ends the job, not the worker. Else parks it."""
        log.warning("envelope_invalid", reason=str(exc), job_id=exc.job_id, attempt=exc.attempt)
        if exc.job_id is not None and exc.attempt is not None:
            report = Report(
                job_id=exc.job_id, attempt=exc.attempt, outcome=Outcome.FAIL, error=str(exc)
            )
            return self._outcome_message(report, _trace_headers(headers))
        parked_headers: dict[str, Any] = dict(headers or {})
        parked_headers["x-pacerd-invalid-reason"] = str(exc)[:1000]
        parked_headers["x-pacerd-source-queue"] = self.queues[destination]
        properties = aiormq.spec.Basic.Properties(
            headers=parked_headers, delivery_mode=2, message_id=offer_message_id,
            content_type=content_type,
        )  # fmt: skip
        if self._configures:
            return Outgoing("", INVALID_QUEUE, body, properties, None)
        # no right to the default exchange: the daemon parks what is no outcome
        if self.outcomes_exchange:
            return Outgoing(self.outcomes_exchange, "", body, properties, None)
        return Outgoing("", OUTCOMES_EXCHANGE, body, properties, None)

    async def _is_current(self, job: Job, *, redelivered: bool = False) -> bool:
        """``pacerd.is_current``, batched with the offers that arrive with it
        (``currency.CurrentCheck``); fails open (the check only saves a costly
        call). A redelivered offer's is asked after ``REDELIVERED_CHECK_DELAY_SECONDS``."""
        if self.current_check is None:
            return True
        if redelivered:
            await self.clock.sleep(REDELIVERED_CHECK_DELAY_SECONDS)
        return await self.current_check.is_current(job.job_id, job.attempt)


def _trace_headers(headers: Mapping[str, Any] | None) -> dict[str, Any]:
    """The offer's W3C trace context, for its outcome when the worker makes no span."""
    if not headers:
        return {}
    return {k: headers[k] for k in ("traceparent", "tracestate") if k in headers}


async def _wait_any(*events: anyio.Event) -> None:
    async with anyio.create_task_group() as tg:

        async def wait(event: anyio.Event) -> None:
            await event.wait()
            tg.cancel_scope.cancel()

        for event in events:
            tg.start_soon(wait, event)


def load_app(app_ref: str) -> WorkerApp:
    """Imports ``module:attribute`` and checks it is a ``WorkerApp``."""
    module_name, _, attribute = app_ref.partition(":")
    if not module_name or not attribute:
        raise ValueError("expected module:attribute, e.g. myproject.workers:app")
    app = getattr(importlib.import_module(module_name), attribute)
    if not isinstance(app, WorkerApp):
        raise TypeError(f"{app_ref} is a {type(app).__name__}, not a pacerd.worker.WorkerApp")
    return app


def main(cfg: Config, *, app_ref: str) -> int:
    """``pacerd worker --app module:app``: runs until SIGTERM/SIGINT (a second one
    abandons in-flight handlers at once); 0 after a graceful stop."""
    try:
        app = load_app(app_ref)
        worker = Worker.from_config(app, cfg)
    except (ImportError, AttributeError, TypeError, ValueError) as exc:
        print(f"pacerd worker: --app {app_ref}: {exc}", file=sys.stderr)
        return EX_USAGE
    telemetry = setup_telemetry(
        f"{cfg.telemetry.service_name}-worker", cfg.telemetry.log_level,
        cfg.telemetry.log_format, set_global=True, instance=instance_name(cfg),
    )  # fmt: skip
    if not telemetry.span_exporters:  # spans nobody would see: none made, the context passed on
        worker.tracer = trace.NoOpTracer()
    try:
        return anyio.run(_serve, worker, backend_options={"use_uvloop": True})
    except KeyboardInterrupt:
        return 130
    finally:
        telemetry.shutdown()


async def _serve(worker: Worker) -> int:
    async with anyio.create_task_group() as tg:

        async def on_signals() -> None:
            with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async for signum in signals:
                    log.info("worker_signal", signal=signal.Signals(signum).name)
                    if worker.stop_requested:
                        tg.cancel_scope.cancel()  # second signal: abandon in-flight work now
                    worker.request_stop()

        tg.start_soon(on_signals)
        await worker.run(task_status=heap.SettleOnStart())
        tg.cancel_scope.cancel()
    return EX_OK
