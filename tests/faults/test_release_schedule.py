"""The release schedule (``pacerd/releases.py``): the slices of ticks planned
whole at their start, published by one task for every destination. pacerd's
own admission runs over the shared fakes on a virtual clock: every job goes
out once, at its destination's pace, the slices due together in one publish;
a tick that stops, closes, loses the broker or whose task leaves sends
nothing after that and releases the rest."""

from __future__ import annotations

import contextlib
import contextvars
import itertools
from collections import defaultdict
from functools import partial
from typing import TYPE_CHECKING

import anyio
from support.fakes import FakeLedger, FakePublisher, VirtualClock

from pacerd.admission import (
    MARKS_PER_TICK,
    AdmissionConfig,
    DestinationAdmission,
    TickResult,
    run_destination,
)
from pacerd.errors import BrokerUnavailable
from pacerd.pacer import BRAKE_MIN_BUDGET, PacingParams
from pacerd.releases import GATHER_SECONDS, ReleaseSchedule

if TYPE_CHECKING:
    from collections.abc import Iterator, Sequence

    from pacerd.models import ClaimedJob, JobRef


class ReasonLedger(FakeLedger):
    """A ``FakeLedger`` that keeps each release's reason, and when it marked
    how many jobs offered."""

    def __init__(self, clock: VirtualClock) -> None:
        super().__init__(clock)
        self.reasons: dict[str, int] = defaultdict(int)
        self.marks: list[tuple[float, int]] = []

    async def mark_offered(self, refs: Sequence[JobRef], *, offer_seconds: float) -> list[JobRef]:
        done = await super().mark_offered(refs, offer_seconds=offer_seconds)
        self.marks.append((self.clock.monotonic(), len(done)))
        return done

    async def release_claims(self, refs: Sequence[JobRef], *, reason: str) -> list[JobRef]:
        done = await super().release_claims(refs, reason=reason)
        self.reasons[reason] += len(done)
        return done


class Sent:
    """The confirmed jobs, with the clock's time of their publish."""

    def __init__(self, clock: VirtualClock) -> None:
        self.clock = clock
        self.at: list[tuple[float, ClaimedJob]] = []

    def __call__(self, jobs: Sequence[ClaimedJob]) -> None:
        self.at.extend((self.clock.monotonic(), job) for job in jobs)


TICK: contextvars.ContextVar[str | None] = contextvars.ContextVar("tick", default=None)


class Spans:
    """An observer that records, for each publish span, the tick span it
    was opened under (a context variable the tick span sets)."""

    def __init__(self) -> None:
        self.publishes: list[tuple[str, str | None]] = []  # (destination, its tick's)

    @contextlib.contextmanager
    def tick_span(self, destination: str, *, shadow: bool) -> Iterator[None]:
        token = TICK.set(destination)
        try:
            yield
        finally:
            TICK.reset(token)

    @contextlib.contextmanager
    def publish_span(
        self, destination: str, jobs: Sequence[ClaimedJob]
    ) -> Iterator[dict[str, str]]:
        self.publishes.append((destination, TICK.get()))
        yield {}

    @contextlib.contextmanager
    def claim_span(self, destination: str, *, limit: int) -> Iterator[None]:
        yield

    @contextlib.contextmanager
    def mark_offered_span(self, destination: str, *, count: int) -> Iterator[None]:
        yield

    def tick_completed(self, result: TickResult) -> None:
        pass


def _params(rate: float) -> PacingParams:
    return PacingParams(
        tick_seconds=1.0, initial_rate=rate, min_rate=rate, max_rate=rate, max_inflight=100_000
    )


def _admission(
    clock: VirtualClock,
    ledger: FakeLedger,
    publisher: FakePublisher,
    schedule: ReleaseSchedule,
    destination: str,
    rate: float,
    observer: Spans | None = None,
) -> DestinationAdmission:
    ledger.add_destination(destination, overdue=None)
    return DestinationAdmission(
        ledger=ledger, publisher=publisher, clock=clock, releases=schedule, observer=observer,
        config=AdmissionConfig(destination=destination, queue="q", params=_params(rate)),
    )  # fmt: skip


async def test_the_slices_of_many_ticks_go_out_once_at_their_pace_together() -> None:
    clock = VirtualClock()
    ledger = ReasonLedger(clock)
    sent = Sent(clock)
    publisher = FakePublisher(clock, on_confirmed=sent)
    schedule = ReleaseSchedule(publisher, clock)
    rate = 4.0  # a budget of 4 a tick: under BRAKE_MIN_BUDGET, never braked mid-tick
    assert rate < BRAKE_MIN_BUDGET
    spans = Spans()
    admissions = [
        _admission(clock, ledger, publisher, schedule, f"d{i}", rate, spans) for i in range(20)
    ]
    stop = anyio.Event()
    with anyio.fail_after(60):  # real seconds
        async with anyio.create_task_group() as tg:
            tg.start_soon(clock.drive, 7.0)
            await tg.start(schedule.run)
            async with anyio.create_task_group() as ticks:
                for admission in admissions:
                    ticks.start_soon(partial(run_destination, admission, stop=stop))
                await clock.sleep_until(6.0)
                stop.set()
            tg.cancel_scope.cancel()

    ids = [job.job_id for _, job in sent.at]
    assert len(ids) == len(set(ids))  # none twice
    released = len(ledger.released)
    assert ledger.claimed == len(ids) + released  # each claimed job sent or released
    assert set(ledger.reasons) <= {"shutdown"}
    by_destination: dict[str, list[float]] = defaultdict(list)
    for at, job in sent.at:
        by_destination[job.destination].append(at)
    for destination, times in by_destination.items():
        # 4 a second, and never two within a quarter second less the grid's
        # step (20 ms) and the schedule's gathering
        assert len(times) >= 4 * 5, destination
        gaps = [b - a for a, b in itertools.pairwise(times)]
        assert min(gaps) >= 0.25 - 0.02 - GATHER_SECONDS, (destination, min(gaps))
    # the slices due within a few milliseconds of each other went out together
    assert schedule.publishes * 2 <= len(ids), (schedule.publishes, len(ids))
    assert publisher.sent == len(ids)
    # each slice's publish span opened under its own tick's span
    assert len(spans.publishes) == len(ids)  # a job a slice at this rate
    assert all(tick == destination for destination, tick in spans.publishes)


async def _one_tick(
    *,
    rate: float = 8.0,
    publisher: FakePublisher | None = None,
    at: float = 0.3,
    act: str,
) -> tuple[TickResult | None, float, ReasonLedger, FakePublisher, Sent, ReleaseSchedule]:
    """One tick of 8 jobs, 0.125 s apart; at ``at`` (virtual): ``act``
    (``leave``: its task is cancelled, ``stop``, ``pause``); then the clock
    runs on to 3 s. The tick's result (None when it left), when it ended."""
    clock = VirtualClock()
    ledger = ReasonLedger(clock)
    sent = Sent(clock)
    publisher = publisher or FakePublisher(clock, on_confirmed=sent)
    schedule = ReleaseSchedule(publisher, clock)
    admission = _admission(clock, ledger, publisher, schedule, "d", rate)
    admission.stop = anyio.Event()
    result: TickResult | None = None
    ended = 0.0
    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            tg.start_soon(clock.drive, 3.0)
            await tg.start(schedule.run)
            with anyio.CancelScope() as scope:

                async def act_at() -> None:
                    await clock.sleep_until(at)
                    if act == "leave":
                        scope.cancel()
                    elif act == "stop":
                        assert admission.stop is not None
                        admission.stop.set()
                    elif act == "pause":
                        ledger.pause("d")

                tg.start_soon(act_at)
                result = await admission.run_once()
            ended = clock.monotonic()
            await clock.sleep_until(3.0)
            tg.cancel_scope.cancel()
    return result, ended, ledger, publisher, sent, schedule


async def test_a_scheduled_tick_marks_its_confirmed_jobs_during_the_tick_and_at_its_end() -> None:
    result, ended, ledger, publisher, sent, schedule = await _one_tick(at=5.0, act="none")
    assert result is not None
    assert result.offered == publisher.sent == len(sent.at) == 8
    assert schedule.publishes == 8  # one destination: a slice a publish
    assert sum(n for _, n in ledger.marks) == 8  # each once
    # off the release schedule, at most MARKS_PER_TICK a tick, the first a
    # fifth of a tick in; the rest at the tick's end
    assert 2 <= len(ledger.marks) <= MARKS_PER_TICK + 1, ledger.marks
    assert ledger.marks[0][0] >= 1.0 / MARKS_PER_TICK
    assert ledger.marks[-1][0] == ended


async def test_a_tick_whose_task_leaves_sends_nothing_more_and_releases_the_rest() -> None:
    result, ended, ledger, publisher, sent, _ = await _one_tick(act="leave")
    assert result is None
    assert ended == 0.3
    # released at 0, 0.125 and 0.25 (each up to 20 ms later, on its grid)
    assert len(sent.at) == 3
    assert publisher.sent == 3  # nothing of it went out after it left
    assert ledger.reasons == {"publish_failed": 5}
    assert {ref.job_id for ref in ledger.released}.isdisjoint(job.job_id for _, job in sent.at)


async def test_a_stop_mid_tick_ends_its_releases_at_the_next_slice() -> None:
    result, ended, ledger, publisher, sent, _ = await _one_tick(act="stop")
    assert result is not None
    assert len(sent.at) == 3
    assert publisher.sent == 3
    assert result.offered == 3
    assert result.released == 5
    assert ledger.reasons == {"shutdown": 5}
    assert ended < 0.375 + 0.02 + GATHER_SECONDS  # at the next release point, not the tick's end


async def test_a_destination_closed_mid_tick_is_sent_nothing_more() -> None:
    result, _ended, ledger, publisher, sent, _ = await _one_tick(act="pause")
    assert result is not None
    assert len(sent.at) == 3
    assert publisher.sent == 3
    assert ledger.reasons == {"destination_closed": 5}


async def test_a_tick_that_loses_the_broker_sends_nothing_after() -> None:
    def down(job: ClaimedJob) -> BrokerUnavailable:
        return BrokerUnavailable("gone")

    publisher = FakePublisher(None, outcome=down)
    result, ended, ledger, _, _, _ = await _one_tick(publisher=publisher, act="none")
    assert result is not None
    assert publisher.sent == 1  # the first slice found the broker gone; no later one tried
    assert result.offered == 0
    assert result.skipped == "broker_down"
    assert ledger.reasons == {"broker_unavailable": 8}
    assert ended < 0.125  # its tick ended with that slice


async def test_a_tick_the_brake_watches_releases_its_own_slices() -> None:
    # slow start (no ceiling yet) with a budget of BRAKE_MIN_BUDGET: watched
    # mid-tick, the brake may reshape its slices; it keeps its own loop
    result, _ended, _ledger, publisher, sent, schedule = await _one_tick(
        rate=float(BRAKE_MIN_BUDGET), at=5.0, act="none"
    )
    assert result is not None
    assert result.offered == BRAKE_MIN_BUDGET == publisher.sent == len(sent.at)
    assert schedule.publishes == 0
