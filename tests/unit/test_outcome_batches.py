"""The outcome consumer's pace (``pacerd.outcomes``), on fakes: a report
that arrives after a quiet spell is applied at once, and a steady stream of
reports is gathered into a batch every ``MIN_INTERVAL_SECONDS`` rather than
one batch per round trip of the statement."""

from __future__ import annotations

import contextlib
import itertools
from typing import TYPE_CHECKING

import anyio
import pytest

from pacerd import outcomes
from pacerd.clock import ManualClock
from pacerd.outcomes import OutcomeConsumer
from pacerd.publisher import Delivery

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Sequence

    from pacerd.models import Report


def report(n: int) -> Delivery:
    body = b'{"job_id": "j-%d", "attempt": 1, "outcome": "ok"}' % n
    return Delivery(body=body, message_id=None, headers={}, delivery_tag=n)


class Stream:
    """A delivery source that has one more report every time it is asked (a
    steady stream), and records when (on the consumer's clock) each batch was
    applied and how large it was."""

    def __init__(self, clock: ManualClock, batches: int) -> None:
        self.clock, self.left = clock, batches
        self.applied: list[tuple[float, int]] = []
        self.arrived: list[float] = []  # when each batch was handed over
        self.done = anyio.Event()
        self.n = 0

    async def next_batch(self) -> list[Delivery]:
        if not self.left:
            self.done.set()
            await anyio.sleep_forever()
        self.left -= 1
        self.n += 1
        self.arrived.append(self.clock.monotonic())
        return [report(self.n)]

    async def ack(self, deliveries: Sequence[Delivery]) -> None:
        pass

    async def requeue(self, deliveries: Sequence[Delivery]) -> None:
        pass

    async def apply_reports(self, reports: Sequence[Report]) -> list[str]:
        self.applied.append((self.clock.monotonic(), len(reports)))
        return ["applied"] * len(reports)

    @contextlib.asynccontextmanager
    async def consume(self, queue: str, *, prefetch: int) -> AsyncIterator[Stream]:
        yield self


async def consume(stream: Stream, clock: ManualClock) -> None:
    """Runs the consumer over ``stream`` until the stream has nothing left."""
    consumer = OutcomeConsumer(ledger=stream, broker=stream, clock=clock)  # type: ignore[arg-type]
    async with anyio.create_task_group() as tg:
        await tg.start(consumer.run)
        with anyio.fail_after(5):
            await stream.done.wait()
        tg.cancel_scope.cancel()


async def test_a_stream_of_reports_is_applied_at_most_once_an_interval() -> None:
    clock = ManualClock(autojump=True)
    stream = Stream(clock, batches=5)
    await consume(stream, clock)
    times = [t for t, _ in stream.applied]
    assert times[0] == 0.0  # the first report, after a quiet spell: at once
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert len(gaps) == 4
    assert all(gap == pytest.approx(outcomes.MIN_INTERVAL_SECONDS) for gap in gaps), gaps


async def test_a_report_after_a_quiet_spell_is_applied_at_once() -> None:
    clock = ManualClock(autojump=True)
    stream = Stream(clock, batches=2)
    first_wait = stream.next_batch

    async def after_a_pause() -> list[Delivery]:
        if stream.n == 1:  # the second report comes a second after the first
            clock.advance(1.0)
        return await first_wait()

    stream.next_batch = after_a_pause  # type: ignore[method-assign]
    await consume(stream, clock)
    # the second came a second after the first: applied as it arrived, no wait
    assert stream.arrived[1] - stream.arrived[0] >= 1.0
    assert [t for t, _ in stream.applied] == stream.arrived
