"""The outcome consumer: reads ``pacerd.outcomes``, applies each report
through the same ledger code as ``pacerd.report``, and acknowledges a batch
only after its database commit. A malformed message is data, not an error: it
is moved to ``pacerd.outcomes.invalid``, logged and counted; it never stops
the daemon.

Parsing (``parse_outcome``) is pure; ``OutcomeConsumer.run_once`` handles one
batch; ``run`` loops, reconnecting through the daemon's broker supervisor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio
import structlog

from pacerd.errors import BrokerUnavailable, LedgerUnavailable, PacerdError
from pacerd.protocol import InvalidOutcome, parse_outcome
from pacerd.publisher import INVALID_QUEUE, OUTCOMES_QUEUE

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from pacerd.clock import Clock
    from pacerd.ledger import Ledger
    from pacerd.models import Report
    from pacerd.publisher import Broker, Delivery, DeliveryBatches

log = structlog.get_logger("pacerd.outcomes")

# Between the starts of two batches, at least (bench/RESULTS.md, "Statements
# at equal throughput"). A report that arrives alone, after a quiet spell, is
# applied at once, so the pacer hears it; a steady stream is gathered into a
# batch every MIN_INTERVAL_SECONDS instead of one per round trip of the
# statement (10 destinations at 120 jobs/s each: 318 transactions a second
# for 1,200 reports, ~4 a batch). It delays a report in a stream by at most
# this, next to the brake's 50 ms reading and a tick's second.
MIN_INTERVAL_SECONDS = 0.01


@dataclass(frozen=True, slots=True, kw_only=True)
class OutcomeResult:
    """What one pass (one batch) did."""

    applied: int = 0
    stale: int = 0
    unknown: int = 0
    invalid: int = 0


class OutcomeConsumer:
    """Applies outcome batches to the ledger; one batch per pass."""

    def __init__(
        self,
        *,
        ledger: Ledger,
        broker: Broker,
        clock: Clock,
        prefetch: int = 500,
        queue: str = OUTCOMES_QUEUE,
        on_result: Callable[[OutcomeResult], None] | None = None,
        on_report: Callable[[Delivery, Report, str], None] | None = None,
        wait_connected: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.ledger = ledger
        self.broker = broker
        self.clock = clock
        self.prefetch = prefetch
        self.queue = queue
        self.on_result = on_result
        self.on_report = on_report
        self.wait_connected = wait_connected

    async def _park(self, delivery: Delivery, why: str) -> None:
        headers: dict[str, Any] = dict(delivery.headers)
        headers["x-pacerd-invalid-reason"] = why[:1000]
        await self.broker.publish_raw(INVALID_QUEUE, delivery.body, headers=headers)
        log.warning(
            "outcome_invalid", reason=why, message_id=delivery.message_id, bytes=len(delivery.body)
        )

    async def run_once(self, batches: DeliveryBatches) -> OutcomeResult:
        deliveries = await batches.next_batch()
        reports: list[Report] = []
        parsed: list[Delivery] = []
        invalid = 0
        for delivery in deliveries:
            try:
                reports.append(parse_outcome(delivery.body))
                parsed.append(delivery)
            except InvalidOutcome as exc:
                await self._park(delivery, str(exc))
                invalid += 1
        try:
            results = await self.ledger.apply_reports(reports)
        except LedgerUnavailable:
            await batches.requeue(deliveries)
            raise
        counts = {"applied": 0, "stale": 0, "unknown": 0}
        for delivery, report, result in zip(parsed, reports, results, strict=True):
            if self.on_report is not None:
                self.on_report(delivery, report, result)
            if result in counts:
                counts[result] += 1
            else:  # refused by the SQL API's own checks: park it too
                await self._park(delivery, result)
                invalid += 1
        await batches.ack(deliveries)
        outcome = OutcomeResult(
            applied=counts["applied"],
            stale=counts["stale"],
            unknown=counts["unknown"],
            invalid=invalid,
        )
        if self.on_result is not None:
            self.on_result(outcome)
        return outcome

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        started = False
        backoff = 0.5
        while True:
            if self.wait_connected is not None:
                await self.wait_connected()
            try:
                async with self.broker.consume(self.queue, prefetch=self.prefetch) as batches:
                    if not started:
                        task_status.started()
                        started = True
                    backoff = 0.5
                    began = -math.inf
                    while True:
                        # the reports that arrive meanwhile join the next batch
                        await self.clock.sleep_until(began + MIN_INTERVAL_SECONDS)
                        began = self.clock.monotonic()
                        await self.run_once(batches)
            except (BrokerUnavailable, LedgerUnavailable) as exc:
                log.warning("outcome_consumer_interrupted", error=str(exc), retry_in=backoff)
            except PacerdError as exc:
                log.error("outcome_consumer_error", error=str(exc), retry_in=backoff)
            if not started:
                task_status.started()
                started = True
            await self.clock.sleep(backoff)
            backoff = min(backoff * 2, 10.0)
