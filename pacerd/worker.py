"""The worker side of the protocol: a small library for Python workers.

Owns what a worker process does with an offer (docs/protocol.md, "Messages"): consume
``pacerd.ready.<destination>`` or a group's shared queue with a bounded prefetch,
decode the envelope and validate it against ``schemas/ready.schema.json``, optionally ask
``pacerd.is_current`` before the costly call, run the registered handler, turn
what it did into an outcome (return → ok with the returned mapping as
``detail``; ``Refused`` → refused; ``Retry`` or any other exception → retry;
``Fail`` → fail; ``Continue`` → continue), publish the outcome with publisher
confirms, and acknowledge the delivery only after that confirm. On stop it
cancels its consumers, gives in-flight handlers a grace period and abandons the
rest unacknowledged: the broker returns them to the queue. It must not write
the ledger: outcomes reach pacerd only as messages (``pacerd.is_current`` is
its one, read-only, query). A malformed envelope never stops it.

    app = WorkerApp(destinations=["llm"], prefetch=16)

    @app.handler("summarize")
    async def summarize(job: Job) -> dict[str, object]:
        ...  # call the upstream with job.idempotency_key
        return {"tokens": 812}

    $ pacerd worker --app mymodule:app -c pacerd.toml
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import math
import signal
import sys
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar

import aio_pika
import aiormq
import anyio
import structlog
from opentelemetry import trace
from opentelemetry.trace import SpanKind

from pacerd.clock import Clock, SystemClock
from pacerd.errors import BrokerUnavailable, ConfigError, LedgerError, PacerdError, PublishError
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
from pacerd.publisher import INVALID_QUEUE, OUTCOMES_EXCHANGE, Broker, message_id, ready_queue_name
from pacerd.publisher import translate_errors as broker_errors
from pacerd.telemetry import extract_context, inject_traceparent, setup_telemetry

if TYPE_CHECKING:
    from aio_pika.abc import (
        AbstractConnection,
        AbstractExchange,
        AbstractIncomingMessage,
        AbstractQueue,
    )
    from anyio.abc import TaskGroup, TaskStatus
    from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

    from pacerd.client import Client
    from pacerd.config import Config

__all__ = [
    "Continue", "Fail", "InvalidEnvelope", "Job", "Refused", "Retry", "Worker", "WorkerApp",
    "WorkerStats", "decode_ready", "load_app", "load_schema", "main", "outcome_body", "to_report",
]  # fmt: skip

log = structlog.get_logger("pacerd.worker")
SPAN_PROCESS = "pacerd.worker.process"
EX_OK, EX_FAILURE, EX_USAGE = 0, 1, 2


Handler = Callable[[Job], Awaitable[object]]
H = TypeVar("H", bound=Handler)


class WorkerApp:
    """The handlers of one worker program, and how its worker runs them.

    ``prefetch`` bounds the unacknowledged offers per queue (so the
    handlers running at once); ``handler_timeout_seconds`` is each handler's
    ``job.deadline``, after which it is cancelled and reported ``retry``.
    ``groups`` names ``[groups.NAME]`` whose shared queues it consumes too (a
    grouped destination's offers are there; the handler gets ``job.destination``).
    """

    def __init__(
        self, *, destinations: Iterable[str] = (), prefetch: int = 16, check_current: bool = True,
        shutdown_grace_seconds: float = 10.0, handler_timeout_seconds: float | None = 240.0,
        groups: Iterable[str] = (),
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
        self._handlers: dict[tuple[str | None, str | None], Handler] = {}

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
            if destination is not None and destination not in self._destinations:
                self._destinations.append(destination)
            return fn

        return register

    def handler_for(self, kind: str, destination: str) -> Handler | None:
        """The most specific handler: kind and destination, kind, destination, any."""
        for key in ((kind, destination), (kind, None), (None, destination), (None, None)):
            if (fn := self._handlers.get(key)) is not None:
                return fn
        return None


@dataclass(slots=True)
class WorkerStats:
    """Counters of one ``Worker`` (tests and logs read them)."""

    received: int = 0
    inflight: int = 0
    outcomes: dict[str, int] = field(default_factory=dict)  # reported and confirmed, by outcome
    skipped: int = 0  # not current: acknowledged without running the handler
    parked: int = 0  # unreportable envelopes moved to pacerd.outcomes.invalid
    publish_failures: int = 0  # outcome publishes nacked or timed out (retried)
    abandoned: int = 0  # handlers cancelled at shutdown, left unacknowledged

    @property
    def reported(self) -> int:
        return sum(self.outcomes.values())


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
    ) -> None:
        self.app, self.broker_url, self.dsn = app, broker_url, dsn
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
        self._stop, self._changed, self._lost = anyio.Event(), anyio.Event(), anyio.Event()
        self._draining, self._started = False, False
        self._client: Client | None = None
        self._connection: AbstractConnection | None = None  # the current session's
        self._client_lock, self._client_retry_at = anyio.Lock(), -math.inf
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
            await self._changed.wait()

    def _notify(self) -> None:
        changed, self._changed = self._changed, anyio.Event()
        changed.set()

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Consumes until ``request_stop()``; ``started()`` once it first consumes."""
        backoff = 0.5
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
            if self._client is not None:
                with anyio.CancelScope(shield=True), anyio.move_on_after(5):
                    await self._client.close()

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
            connection = await aio_pika.connect(self.broker_url, timeout=10)
        self._lost = lost = anyio.Event()
        connection.close_callbacks.add(lambda *_: lost.set())
        self._connection = connection
        send, receive = anyio.create_memory_object_stream[tuple["AbstractIncomingMessage", str]](
            math.inf
        )
        try:
            with broker_errors():
                outcomes = await connection.channel(publisher_confirms=True, on_return_raises=True)
                channel = await connection.channel(publisher_confirms=False)
                await channel.set_qos(prefetch_count=self.app.prefetch)
                exchange = outcomes.default_exchange
                if self.outcomes_exchange:
                    exchange = await outcomes.get_exchange(self.outcomes_exchange, ensure=True)
                consumers = []
                for destination, name in self.queues.items():
                    queue = await channel.declare_queue(name, passive=True)
                    tag = await queue.consume(partial(self._deliver, send, destination))
                    consumers.append((queue, tag))
            self._draining = False
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._dispatch, receive, tg, exchange, outcomes.default_exchange)
                if not self._started:
                    self._started = True
                    task_status.started()
                log.info("worker_started", queues=sorted(self.queues.values()))
                await _wait_any(self._stop, lost)
                if not lost.is_set():
                    await self._drain(consumers)
                tg.cancel_scope.cancel()  # what is left is abandoned, unacknowledged
            if not self._stop.is_set():
                raise BrokerUnavailable("the broker connection was lost")
            log.info("worker_stopped", abandoned=self.stats.abandoned, **self.stats.outcomes)
        finally:
            send.close()
            receive.close()
            with anyio.CancelScope(shield=True), anyio.move_on_after(5):
                await connection.close()  # whatever was not acknowledged goes back to the queue

    async def _drain(self, consumers: list[tuple[AbstractQueue, str]]) -> None:
        """Stop consuming; in-flight handlers get the grace period."""
        self._draining = True
        log.info("worker_stopping", inflight=self.stats.inflight)
        with anyio.move_on_after(5), contextlib.suppress(PacerdError), broker_errors():
            for queue, tag in consumers:
                await queue.cancel(tag)  # if it fails, closing the connection cancels them
        with anyio.move_on_after(self.app.shutdown_grace_seconds):
            await self.wait_until(lambda s: s.inflight == 0)
        self.stats.abandoned += self.stats.inflight

    async def _deliver(
        self,
        send: MemoryObjectSendStream[tuple[AbstractIncomingMessage, str]],
        destination: str,
        message: AbstractIncomingMessage,
    ) -> None:
        with contextlib.suppress(anyio.ClosedResourceError):  # stopping: it returns to the queue
            send.send_nowait((message, destination))

    async def _dispatch(
        self,
        receive: MemoryObjectReceiveStream[tuple[AbstractIncomingMessage, str]],
        tg: TaskGroup,
        exchange: AbstractExchange,
        default_exchange: AbstractExchange,
    ) -> None:
        async for message, destination in receive:
            if self._draining:  # buffered, never started: hand it back at once
                with anyio.move_on_after(5), contextlib.suppress(PacerdError), broker_errors():
                    await message.nack(requeue=True)  # else it returns when the connection closes
                continue
            self.stats.received += 1
            self.stats.inflight += 1
            self._notify()
            tg.start_soon(self._process, message, destination, exchange, default_exchange)

    async def _process(
        self,
        message: AbstractIncomingMessage,
        destination: str,
        exchange: AbstractExchange,
        default_exchange: AbstractExchange,
    ) -> None:
        try:
            try:
                job = decode_ready(
                    message.body, clock=self.clock, message_id=message.message_id,
                    correlation_id=message.correlation_id,
                )  # fmt: skip
            except InvalidEnvelope as exc:
                await self._invalid(message, destination, exc, exchange, default_exchange)
                return
            headers = dict(message.headers or {})
            attributes: dict[str, str | int] = {
                "messaging.system": "rabbitmq", "messaging.operation.type": "process",
                "messaging.destination.name": self.queues[destination],
                "messaging.message.id": message.message_id or "",
                "messaging.message.conversation_id": job.job_id, "pacerd.job_id": job.job_id,
                "pacerd.attempt": job.attempt, "pacerd.kind": job.kind,
                "pacerd.destination": job.destination,
            }  # fmt: skip
            with self.tracer.start_as_current_span(
                SPAN_PROCESS, context=extract_context(headers), kind=SpanKind.CONSUMER,
                attributes=attributes,
            ) as span:  # fmt: skip
                if not await self._is_current(job):
                    log.info("offer_not_current", job_id=job.job_id, attempt=job.attempt)
                    await self._ack(message)
                    self.stats.skipped += 1
                    return
                report = await self._run_handler(job)
                span.set_attribute("pacerd.outcome", str(report.outcome))
                await self._report(report, message, exchange)
        except PacerdError as exc:  # the broker went away: unacknowledged, redelivered
            log.warning("delivery_interrupted", error=str(exc), message_id=message.message_id)
            self._lost.set()
        finally:
            self.stats.inflight -= 1
            self._notify()

    async def _run_handler(self, job: Job) -> Report:
        handler = self.app.handler_for(job.kind, job.destination)
        if handler is None:
            error = f"no handler registered for kind {job.kind!r} (destination {job.destination!r})"
            return Report(job_id=job.job_id, attempt=job.attempt, outcome=Outcome.FAIL, error=error)
        timeout = self.handler_timeout_seconds
        if timeout is not None:
            job = dataclasses.replace(job, deadline=self.clock.monotonic() + timeout)
        result: object = None
        raised: Exception | None = None
        with anyio.move_on_after(timeout) as scope:
            try:
                result = await handler(job)
            except (Refused, Retry, Fail, Continue) as exc:
                raised = exc
            except Exception as exc:  # any other error is the handler's: reported as retry
                log.warning("handler_error", job_id=job.job_id, attempt=job.attempt, exc_info=exc)
                raised = exc
        if scope.cancelled_caught:
            raised = Retry(
                f"the handler ran past its deadline ({timeout} s); to checkpoint a long job,"
                " raise Continue(cursor) before job.deadline"
            )
        return to_report(job.job_id, job.attempt, result=result, raised=raised)

    async def _report(
        self, report: Report, message: AbstractIncomingMessage, exchange: AbstractExchange
    ) -> None:
        """Publishes the outcome and, once the broker confirmed it, acknowledges the offer."""
        try:
            body = outcome_body(report)
        except (TypeError, ValueError) as exc:  # the work is done: keep the ok, drop the detail
            detail = {"detail_error": f"the handler's result is not JSON: {exc}"}
            body = outcome_body(dataclasses.replace(report, detail=detail))
        outcome = aio_pika.Message(
            body, content_type="application/json", delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
            message_id=message_id(report.job_id, report.attempt), correlation_id=report.job_id,
            headers=dict(inject_traceparent({})),
        )  # fmt: skip
        routing_key = "" if self.outcomes_exchange else OUTCOMES_EXCHANGE
        await self._publish_confirmed(exchange, outcome, routing_key)
        counts = self.stats.outcomes
        counts[report.outcome] = counts.get(report.outcome, 0) + 1
        await self._ack(message)

    async def _publish_confirmed(
        self, exchange: AbstractExchange, message: aio_pika.Message, routing_key: str
    ) -> None:
        """Until the broker confirms; a nack or a timeout is retried, a lost broker raises."""
        backoff = 0.2
        while True:
            try:
                with broker_errors():
                    await exchange.publish(
                        message, routing_key, mandatory=True, timeout=self.publish_timeout_seconds
                    )
                return
            except BrokerUnavailable:
                raise
            except PublishError as exc:
                self.stats.publish_failures += 1
                self._notify()
                log.warning("outcome_publish_failed", error=str(exc), retry_in=backoff)
                await self.clock.sleep(backoff)
                backoff = min(backoff * 2, 5.0)

    async def _ack(self, message: AbstractIncomingMessage) -> None:
        with broker_errors():
            await message.ack()

    async def _invalid(
        self,
        message: AbstractIncomingMessage,
        destination: str,
        exc: InvalidEnvelope,
        exchange: AbstractExchange,
        default_exchange: AbstractExchange,
    ) -> None:
        """Reports ``fail`` when the envelope names an attempt (in its body or,
        when the body cannot say, in its ``message_id``/``correlation_id``):
        that ends the job, not the worker. Else parks it."""
        log.warning("envelope_invalid", reason=str(exc), job_id=exc.job_id, attempt=exc.attempt)
        if exc.job_id is not None and exc.attempt is not None:
            report = Report(
                job_id=exc.job_id, attempt=exc.attempt, outcome=Outcome.FAIL, error=str(exc)
            )
            await self._report(report, message, exchange)
            return
        headers: dict[str, Any] = dict(message.headers or {})
        headers["x-pacerd-invalid-reason"] = str(exc)[:1000]
        headers["x-pacerd-source-queue"] = self.queues[destination]
        parked = aio_pika.Message(
            message.body, headers=headers, delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
            message_id=message.message_id, content_type=message.content_type,
        )  # fmt: skip
        if self._configures:
            await self._publish_confirmed(default_exchange, parked, INVALID_QUEUE)
        else:  # no right to the default exchange: the daemon parks what is no outcome
            routing_key = "" if self.outcomes_exchange else OUTCOMES_EXCHANGE
            await self._publish_confirmed(exchange, parked, routing_key)
        await self._ack(message)
        self.stats.parked += 1

    async def _is_current(self, job: Job) -> bool:
        """``pacerd.is_current``; fails open (the check only saves a costly call)."""
        if not self.app.check_current or self.dsn is None:
            return True
        async with self._client_lock:
            if self._client is None and self.clock.monotonic() >= self._client_retry_at:
                from pacerd.client import Client

                try:
                    self._client = await Client.connect(self.dsn, max_size=2)
                except LedgerError as exc:
                    self._client_retry_at = self.clock.monotonic() + 5.0
                    log.warning("is_current_unavailable", error=str(exc))
        if self._client is None:
            return True
        try:
            return await self._client.is_current(job.job_id, job.attempt)
        except LedgerError as exc:
            log.warning("is_current_unavailable", error=str(exc))
            return True


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
        cfg.telemetry.log_format, set_global=True,
    )  # fmt: skip
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
        await worker.run()
        tg.cancel_scope.cancel()
    return EX_OK
