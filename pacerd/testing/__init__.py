"""Tools for testing pacerd, kept apart from the daemon: a model upstream
(``upstream``), which the tests, the benchmarks and the demo (``pacerd_demo``,
its own package) call; and two hand-cranked halves of the daemon for tests
that run workers without it: ``offer_due`` offers due jobs exactly the way the
daemon publishes them (claim, publish with confirms and a ``traceparent``, mark
offered) without any pacing; ``apply_outcomes`` applies what reaches the shared
``pacerd.outcomes`` queue with the daemon's own ``OutcomeConsumer``, and
``OutcomeTap`` applies a private copy of the outcomes (safe when other
consumers share the broker); ``take_parked`` reads what a worker parked in
``pacerd.outcomes.invalid``.

Nothing in the daemon imports this package.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import aio_pika

from pacerd.clock import SystemClock
from pacerd.outcomes import OutcomeConsumer, OutcomeResult
from pacerd.protocol import InvalidOutcome, parse_outcome
from pacerd.publisher import INVALID_QUEUE, OUTCOMES_EXCHANGE, OUTCOMES_QUEUE, ready_queue_name
from pacerd.telemetry import inject_traceparent

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

    from aio_pika.abc import AbstractConnection, AbstractIncomingMessage

    from pacerd.ledger import Ledger
    from pacerd.models import ClaimedJob
    from pacerd.publisher import Broker

__all__ = ["OutcomeTap", "TappedOutcome", "apply_outcomes", "offer_due", "take_parked"]


async def offer_due(
    ledger: Ledger,
    broker: Broker,
    destination: str,
    *,
    limit: int = 100,
    offer_seconds: float = 60.0,
    claim_seconds: float = 30.0,
    instance: str = "pacerd-testing",
    headers: Mapping[str, str] | None = None,
) -> list[ClaimedJob]:
    """Claims up to ``limit`` due jobs of ``destination``, publishes each to
    ``pacerd.ready`` (``headers``, default: the current span's ``traceparent``)
    and marks the confirmed ones offered; returns them."""
    await broker.declare_destination(destination, ready_queue_name(destination))
    jobs = await ledger.claim_due(
        destination,
        live_limit=0,
        limit=limit,
        claim_seconds=claim_seconds,
        epoch=0,
        live_window_seconds=0.0,
        instance=instance,
    )
    for job in jobs:
        await broker.publish(job, inject_traceparent({}) if headers is None else headers)
    await ledger.mark_offered([job.ref for job in jobs], offer_seconds=offer_seconds)
    return jobs


async def apply_outcomes(
    ledger: Ledger, broker: Broker, *, count: int, prefetch: int = 100
) -> OutcomeResult:
    """Applies outcome messages from ``pacerd.outcomes`` until ``count`` were
    handled (applied, stale, unknown or parked); returns the totals. Wrap it in
    ``fail_after``: it waits for messages."""
    consumer = OutcomeConsumer(ledger=ledger, broker=broker, clock=SystemClock(), prefetch=prefetch)
    applied = stale = unknown = invalid = 0
    async with broker.consume(OUTCOMES_QUEUE, prefetch=prefetch) as batches:
        while applied + stale + unknown + invalid < count:
            result = await consumer.run_once(batches)
            applied, stale = applied + result.applied, stale + result.stale
            unknown, invalid = unknown + result.unknown, invalid + result.invalid
    return OutcomeResult(applied=applied, stale=stale, unknown=unknown, invalid=invalid)


@dataclass(frozen=True, slots=True, kw_only=True)
class TappedOutcome:
    """One outcome message as a worker sent it, and what the ledger answered."""

    doc: Any  # the decoded body (None when it is not JSON)
    message_id: str | None
    correlation_id: str | None
    content_type: str | None
    headers: dict[str, Any]
    result: str  # 'applied', 'stale', 'unknown', or 'invalid: <why>'


class OutcomeTap:
    """A private copy of every outcome published to the ``pacerd.outcomes``
    exchange (an exclusive queue bound to the fanout), applied to one ledger
    with pacerd's own ``parse_outcome`` and ``Ledger.apply_reports``. Outcomes
    whose job id ``accept`` refuses (another test's, another run's) are skipped."""

    def __init__(
        self, amqp_url: str, ledger: Ledger, accept: Callable[[str], bool] | None = None
    ) -> None:
        self.amqp_url, self.ledger, self.accept = amqp_url, ledger, accept
        self._messages: asyncio.Queue[AbstractIncomingMessage] = asyncio.Queue()
        self._connection: AbstractConnection | None = None

    async def __aenter__(self) -> OutcomeTap:
        self._connection = await aio_pika.connect(self.amqp_url)
        channel = await self._connection.channel()
        queue = await channel.declare_queue(exclusive=True)
        await queue.bind(OUTCOMES_EXCHANGE)
        await queue.consume(self._messages.put)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if self._connection is not None:
            await self._connection.close()

    async def apply(self, count: int) -> list[TappedOutcome]:
        """The next ``count`` accepted outcomes, each applied (wrap it in ``fail_after``)."""
        tapped: list[TappedOutcome] = []
        while len(tapped) < count:
            message = await self._messages.get()
            await message.ack()
            try:
                doc = json.loads(message.body)
            except ValueError:
                doc = None
            job_id = doc.get("job_id") if isinstance(doc, dict) else None
            if self.accept is not None and not (isinstance(job_id, str) and self.accept(job_id)):
                continue
            try:
                result = (await self.ledger.apply_reports([parse_outcome(message.body)]))[0]
            except InvalidOutcome as exc:
                result = f"invalid: {exc}"
            tapped.append(
                TappedOutcome(
                    doc=doc, message_id=message.message_id, correlation_id=message.correlation_id,
                    content_type=message.content_type, headers=dict(message.headers or {}),
                    result=result,
                )
            )  # fmt: skip
        return tapped


async def take_parked(
    amqp_url: str, source_queue: str, count: int
) -> list[AbstractIncomingMessage]:
    """The next ``count`` messages a worker parked from ``source_queue`` (by its
    ``x-pacerd-source-queue`` header); others' parked messages are left in place."""
    mine: list[AbstractIncomingMessage] = []
    connection = await aio_pika.connect(amqp_url)
    async with connection:
        channel = await connection.channel()
        queue = await channel.get_queue(INVALID_QUEUE)
        foreign = []
        async with queue.iterator() as messages:
            async for message in messages:
                source = (message.headers or {}).get("x-pacerd-source-queue")
                if isinstance(source, bytes):
                    source = source.decode()
                if source != source_queue:
                    foreign.append(message)
                    continue
                await message.ack()
                mine.append(message)
                if len(mine) == count:
                    break
        for message in foreign:
            await message.nack(requeue=True)
    return mine
