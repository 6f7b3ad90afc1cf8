"""Where each tick's spans and figures go: OpenTelemetry and the log.

The admission code reports through the ``admission.TickObserver`` protocol;
this is its implementation for the daemon (tests record with their own).
"""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any

import anyio
import structlog

from pacerd.errors import PacerdError
from pacerd.publisher import message_id
from pacerd.roundtrips import ReleaseTimes
from pacerd.telemetry import inject_traceparent

if TYPE_CHECKING:
    from collections.abc import Iterator, Mapping, Sequence
    from typing import Protocol

    from pacerd.admission import TickResult
    from pacerd.clock import Clock
    from pacerd.ledger import Ledger
    from pacerd.models import ClaimedJob, Report
    from pacerd.outcomes import OutcomeResult
    from pacerd.publisher import Delivery
    from pacerd.reconciler import ReconcileResult
    from pacerd.sdnotify import Notifier
    from pacerd.telemetry import Telemetry

    class _Daemon(Protocol):
        stop_requested: anyio.Event
        notifier: Notifier
        clock: Clock


log = structlog.get_logger("pacerd.daemon")


class TelemetryObserver:
    """Hands each tick's figures to OpenTelemetry and the log."""

    def __init__(
        self, telemetry: Telemetry | None, clock: Clock, offer_seconds: float = 300.0
    ) -> None:
        self.telemetry = telemetry
        self.clock = clock
        # when each job was released here (its offer lease at most), for the
        # outcome consumer's round trips (``OutcomeObserver``)
        self.releases = ReleaseTimes(clock, horizon_seconds=offer_seconds)
        self.last: dict[str, TickResult] = {}
        self.due: dict[str, tuple[int, float | None]] = {}

    def forget(self, destination: str) -> None:
        """A destination parked or no longer led: its figures leave memory."""
        self.last.pop(destination, None)
        self.due.pop(destination, None)
        if self.telemetry is not None:
            self.telemetry.forget_destination(destination)

    def count_statements(self, *counts: Mapping[str, int]) -> None:
        """The statements sent so far, by name (``Telemetry.count_statements``)."""
        if self.telemetry is not None:
            self.telemetry.count_statements(*counts)

    def tick_span(self, destination: str, *, shadow: bool) -> AbstractContextManager[Any]:
        if self.telemetry is None:
            return nullcontext()
        return self.telemetry.tick_span(destination, shadow=shadow)

    def claim_span(self, destination: str, *, limit: int) -> AbstractContextManager[Any]:
        if self.telemetry is None:
            return nullcontext()
        return self.telemetry.claim_span(destination, limit=limit)

    @contextlib.contextmanager
    def publish_span(
        self, destination: str, jobs: Sequence[ClaimedJob]
    ) -> Iterator[dict[str, str]]:
        headers: dict[str, str] = {}
        if self.telemetry is None:
            yield headers
            return
        # the message ids are the span's attributes: none when spans are not recorded
        recorded = self.telemetry.record_spans
        messages = [message_id(job.job_id, job.attempt) for job in jobs] if recorded else []
        with self.telemetry.publish_span(destination, messages=messages):
            inject_traceparent(headers)
            began = self.clock.monotonic()
            yield headers  # the slice is published and its confirms awaited here
            seconds = self.clock.monotonic() - began
        self.telemetry.record_publish(destination, confirm_seconds=seconds)
        if jobs:  # one job a slice: a sample, spread over time, that costs nothing per job
            self.releases.released(destination, jobs[0].job_id, jobs[0].attempt)

    def mark_offered_span(self, destination: str, *, count: int) -> AbstractContextManager[Any]:
        if self.telemetry is None:
            return nullcontext()
        return self.telemetry.mark_offered_span(destination, count=count)

    def status_line(self) -> str:
        """systemd's STATUS: the destinations ticking here, busiest first (at most 5)."""
        parts = []
        busiest = sorted(self.last.values(), key=lambda r: -self.due.get(r.destination, (0,))[0])
        for result in busiest[:5]:
            due, oldest = self.due.get(result.destination, (0, None))
            age = f"{oldest:.0f}s" if oldest is not None else "-"
            parts.append(f"{result.destination} {result.rate:.1f}/s due {due} oldest {age}")
        more = f" (+{len(self.last) - 5} more)" if len(self.last) > 5 else ""
        return "; ".join(parts) + more if parts else "running, no destination active"

    def tick_completed(self, result: TickResult) -> None:
        self.last[result.destination] = result
        due, oldest_age = self.due.get(result.destination, (0, None))
        eta = due / result.rate if result.rate > 0 and due else None
        if self.telemetry is not None:
            self.telemetry.record_tick(
                result.destination,
                rate=result.rate,
                budget=result.budget,
                admitted=result.offered if not result.shadow else result.claimed,
                inflight=result.inflight,
                due=due,
                oldest_due_age_seconds=oldest_age,
                drain_eta_seconds=eta,
                refused=result.refused,
                duration_seconds=result.planning_seconds,
                shadow=result.shadow,
            )
            self.telemetry.record_admission_state(
                result.destination,
                paused=result.skipped == "paused",
                paused_locally=result.skipped == "paused_local",
                cooldown=result.skipped == "cooldown",
            )
            self.telemetry.record_publish(
                result.destination, nacked=result.nacked, returned=result.returned,
                timeouts=result.confirm_timeouts,
            )  # fmt: skip
        log.debug(
            "tick_completed",
            destination=result.destination,
            skipped=result.skipped,
            rate=round(result.rate, 3),
            budget=result.budget,
            claimed=result.claimed,
            offered=result.offered,
            released=result.released,
            inflight=result.inflight,
            accepted=result.accepted,
            refused=result.refused,
        )


class OutcomeObserver:
    """Counts applied outcomes and reclaimed leases, times the round trips of
    the jobs released here, and traces the rare outcomes."""

    def __init__(self, telemetry: Telemetry | None, releases: ReleaseTimes | None = None) -> None:
        self.telemetry = telemetry
        self.releases = releases  # when the jobs this instance released went out
        self._ok_applied = 0  # `ok` reports applied since the last batch was counted

    def on_report(self, delivery: Delivery, report: Report, result: str) -> None:
        """One outcome applied: its round trip (when released here), a span
        continuing the worker's trace, and a count. The common case (an `ok`
        applied) is only counted, per batch: a span per report was a fifth of
        the daemon's CPU at full speed."""
        if self.telemetry is None:
            return
        if result == "applied" and self.releases is not None:
            heard = self.releases.heard(report.job_id, report.attempt)
            if heard is not None:
                self.telemetry.record_round_trip(*heard)
        if result == "applied" and report.outcome == "ok":
            self._ok_applied += 1
            return
        with self.telemetry.outcome_span(
            delivery.headers, job_id=report.job_id, attempt=report.attempt,
            outcome=str(report.outcome),
        ) as span:  # fmt: skip
            self.telemetry.record_outcome(str(report.outcome), result, span=span)

    def on_outcomes(self, result: OutcomeResult) -> None:
        if self.telemetry is None:
            return
        if self._ok_applied:
            self.telemetry.count_outcomes("ok", "applied", self._ok_applied)
            self._ok_applied = 0
        if result.invalid:
            self.telemetry.outcomes_invalid.add(result.invalid, {"reason": "malformed"})

    def on_reconcile(self, result: ReconcileResult) -> None:
        if self.telemetry is not None and result.total:
            self.telemetry.record_reconcile(
                claims_released=result.claims_returned,
                offers_rescheduled=result.offers_returned,
                offers_dead=result.dead,
            )


async def due_metrics(ledger: Ledger, daemon: _Daemon, observer: TelemetryObserver) -> None:
    """Due counts of the woken destinations for status and metrics, on a
    slower cadence (they count rows): at most 1/20 of the time."""
    clock = daemon.clock
    while not daemon.stop_requested.is_set():
        began = clock.monotonic()
        try:
            for row in await ledger.due_summary(woken_only=True):
                oldest = row.oldest_scheduled_at
                age = (clock.now() - oldest).total_seconds() if oldest else None
                observer.due[row.destination] = (row.due, age)
                if observer.telemetry is not None:
                    observer.telemetry.record_dead(row.destination, row.dead)
            daemon.notifier.status(observer.status_line())
        except PacerdError as exc:
            log.warning("due_summary_failed", error=str(exc))
        pause = max(5.0, 20 * (clock.monotonic() - began))
        with anyio.move_on_after(pause):
            await daemon.stop_requested.wait()
