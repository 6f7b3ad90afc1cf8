"""A busy tick on a modest host, simulated: every ledger statement and every
publish costs 2 ms of the event loop's own time (serial: one loop) and 3 ms of
waiting for the other side (concurrent) — on the loaded host of the full fault
runs, busy ticks came every 0.6-0.9 s with ``tick_seconds = 0.2``. pacerd's own
admission loop (``run_destination``) runs against fakes on a virtual clock that
moves to the next sleeper's deadline only when every task is waiting, so the
result is exact and takes no real time."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime as dt
import itertools
from typing import TYPE_CHECKING, Any

import anyio
from support.fakes import FakePublisher, VirtualClock
from support.publisher_contract import job
from tickrig import Costs, FreeCosts, SlowLedger, Ticks, run_loop

from pacerd.admission import (
    BROKER_BACKOFF_MAX_SECONDS,
    MAX_UNCONFIRMED,
    AdmissionConfig,
    DestinationAdmission,
    _Slices,
)
from pacerd.errors import LedgerUnavailable, PublishError, PublishTimeout
from pacerd.pacer import PacingParams

if TYPE_CHECKING:
    from collections.abc import Iterator, Mapping, Sequence

    from pacerd.models import ClaimedJob, DestinationRow

TICK_SECONDS = 0.2
RATE = 300.0
SIMULATED_SECONDS = 4.0


async def test_a_busy_tick_ends_by_its_deadline_and_the_loop_admits_its_rate() -> None:
    clock = VirtualClock()
    stop = anyio.Event()
    ticks = Ticks(clock, stop, until=SIMULATED_SECONDS)
    costs = Costs(clock)
    ledger = SlowLedger(clock, costs)
    params = PacingParams(
        tick_seconds=TICK_SECONDS, initial_rate=RATE, min_rate=RATE, max_rate=RATE,
        max_inflight=1_000_000,
    )  # fmt: skip
    admission = DestinationAdmission(
        ledger=ledger, publisher=FakePublisher(price=costs.operation), clock=clock,
        config=AdmissionConfig(destination="d", queue="q", params=params), observer=ticks,
    )  # fmt: skip
    await run_loop(clock, admission, stop, SIMULATED_SECONDS + 1)
    busy = [t for t, r in ticks.done if r.claimed > 0]
    gaps = sorted(b - a for a, b in itertools.pairwise(busy))
    median_gap = gaps[len(gaps) // 2]
    admitted = sum(r.claimed for t, r in ticks.done[1:]) / (busy[-1] - busy[0])
    assert 0.9 * RATE <= admitted <= 1.1 * RATE, f"admitted {admitted:.0f}/s at {RATE:.0f}/s"
    # A skipped tick means the next one releases two ticks' budget in one tick's span:
    # twice the pacer's rate half of the time, instead of its rate evenly.
    assert median_gap <= 1.25 * TICK_SECONDS, f"a busy tick every {median_gap:.3f} s"


class StalledPublisher(FakePublisher):
    """A broker that holds every confirm past the publish timeout until ``until``
    (a memory alarm), then confirms at once; counts what was sent meanwhile."""

    def __init__(self, clock: VirtualClock, until: float, timeout: float) -> None:
        super().__init__(clock)
        self.until, self.timeout = until, timeout
        self.sent_while_stalled = 0

    async def publish_many(
        self, jobs: Sequence[ClaimedJob], headers: Sequence[Mapping[str, str]]
    ) -> list[PublishError | None]:
        assert self.clock is not None
        if self.clock.monotonic() >= self.until:
            return await super().publish_many(jobs, headers)
        self.sent_while_stalled += len(jobs)
        await self.clock.sleep(self.timeout)
        return [PublishTimeout() for _ in jobs]


async def test_after_confirm_timeouts_admission_backs_off_and_probes_with_one_job() -> None:
    clock = VirtualClock()
    stop = anyio.Event()
    stalled_until, timeout, rate = 12.0, 1.0, 50.0
    ticks = Ticks(clock, stop, until=20.0)
    ledger = SlowLedger(clock, Costs(clock))
    publisher = StalledPublisher(clock, stalled_until, timeout)
    params = PacingParams(
        tick_seconds=0.5, initial_rate=rate, min_rate=rate, max_rate=rate, max_inflight=1_000_000
    )
    admission = DestinationAdmission(
        ledger=ledger, publisher=publisher, clock=clock,
        config=AdmissionConfig(destination="d", queue="q", params=params), observer=ticks,
    )  # fmt: skip
    await run_loop(clock, admission, stop, 21.0)
    stalled = [r for t, r in ticks.done if t < stalled_until]
    probes = [r for r in stalled if r.claimed == 1]
    # the first tick's budget times out; after it, one job at a time, ever more rarely
    assert stalled[0].claimed > 1
    assert all(r.claimed <= 1 for r in stalled[1:]), [r.claimed for r in stalled]
    assert [r.skipped for r in stalled].count("broker_down") >= 5
    assert 3 <= len(probes) <= 6, f"{len(probes)} probes in {stalled_until:.0f} s"
    assert publisher.sent_while_stalled == stalled[0].claimed + len(probes)
    # once the broker takes messages again, the next probe succeeds and the rate resumes
    after = [(t, r) for t, r in ticks.done if t >= stalled_until + BROKER_BACKOFF_MAX_SECONDS]
    assert after
    assert all(r.claimed >= rate * params.tick_seconds * 0.8 for _, r in after[1:])
    assert all(r.skipped is None for _, r in after)


async def test_releases_wait_for_confirms_when_the_broker_lags_the_rate() -> None:
    clock = VirtualClock()
    stop = anyio.Event()
    rate, delay = 5_000.0, 0.5  # 100 a slice every 20 ms; each slice confirmed 0.5 s later
    ticks = Ticks(clock, stop, until=6.0)
    publisher = FakePublisher(clock, confirm_seconds=delay)  # the most awaiting at once: peak
    params = PacingParams(
        tick_seconds=1.0, initial_rate=rate, min_rate=rate, max_rate=rate, max_inflight=10**7
    )
    admission = DestinationAdmission(
        ledger=SlowLedger(clock, Costs(clock)), publisher=publisher, clock=clock,
        config=AdmissionConfig(destination="d", queue="q", params=params), observer=ticks,
    )  # fmt: skip
    await run_loop(clock, admission, stop, 60.0)
    assert publisher.peak <= MAX_UNCONFIRMED
    # the broker's pace (1,000 per 0.5 s), not the rate's, and nothing failed for it
    assert all(r.released == 0 for _, r in ticks.done)
    elapsed = ticks.done[-1][0]
    assert publisher.confirmed >= 0.8 * MAX_UNCONFIRMED / delay * elapsed


class FlakyLedger(SlowLedger):
    """Reading the destination fails between ``down_from`` and ``down_until``
    (a session terminated under that one statement); the rest works."""

    def __init__(self, clock: VirtualClock, down_from: float, down_until: float) -> None:
        super().__init__(clock, Costs(clock))
        self.down_from, self.down_until = down_from, down_until
        self.failed_calls = 0

    async def read_destination(
        self, destination: str, *, inflight: bool = False
    ) -> DestinationRow | None:
        row = await super().read_destination(destination, inflight=inflight)
        if self.down_from <= self.clock.monotonic() < self.down_until:
            self.failed_calls += 1
            raise LedgerUnavailable("the ledger went away: terminating connection")
        return row


async def test_a_ledger_lost_mid_tick_stops_the_tick_not_the_loop() -> None:
    clock = VirtualClock()
    stop = anyio.Event()
    ticks = Ticks(clock, stop, until=6.0)
    ledger = FlakyLedger(clock, down_from=1.3, down_until=1.9)  # inside the second tick
    params = PacingParams(
        tick_seconds=1.0, initial_rate=100.0, min_rate=100.0, max_rate=100.0, max_inflight=10**6
    )
    admission = DestinationAdmission(
        ledger=ledger, publisher=FakePublisher(clock, confirm_seconds=0.01), clock=clock,
        config=AdmissionConfig(destination="d", queue="q", params=params), observer=ticks,
    )  # fmt: skip
    await run_loop(clock, admission, stop, 30.0)  # raises nothing
    assert ledger.failed_calls > 0
    (stopped,) = [(t, r) for t, r in ticks.done if r.released > 0]
    assert 1.3 < stopped[0] < 2.0
    assert 0 < stopped[1].offered < stopped[1].claimed  # it stopped releasing then
    assert stopped[1].offered + stopped[1].released == stopped[1].claimed  # returned the rest
    later = [r for t, r in ticks.done if t >= 2.0]
    assert len(later) >= 3
    assert all(r.claimed > 0 and r.released == 0 for r in later)


class RecordingPublisher(FakePublisher):
    """Records each release: (start of the tick publishing it, time)."""

    def __init__(self, clock: VirtualClock, starts: list[float]) -> None:
        super().__init__(clock)
        self.starts = starts
        self.releases: list[tuple[float, float]] = []

    async def publish_many(
        self, jobs: Sequence[ClaimedJob], headers: Sequence[Mapping[str, str]]
    ) -> list[PublishError | None]:
        assert self.clock is not None
        self.releases.append((self.starts[-1], self.clock.monotonic()))
        return await super().publish_many(jobs, headers)


class TickStarts(Ticks):
    """Also records when each tick starts."""

    def __init__(self, clock: VirtualClock, stop: anyio.Event, until: float) -> None:
        super().__init__(clock, stop, until)
        self.starts: list[float] = []

    @contextlib.contextmanager
    def tick_span(self, *_args: object, **_kwargs: object) -> Iterator[Any]:
        self.starts.append(self.clock.monotonic())
        yield {}


async def _release_times(destination: str, ticks: int) -> list[list[float]]:
    """Each tick's release times, relative to its start (rate 100/s, tick 1 s)."""
    clock = VirtualClock()
    stop = anyio.Event()
    recorder = TickStarts(clock, stop, until=ticks - 0.5)
    publisher = RecordingPublisher(clock, recorder.starts)
    params = PacingParams(
        tick_seconds=1.0, initial_rate=100.0, min_rate=100.0, max_rate=100.0,
        max_inflight=1_000_000,
    )  # fmt: skip
    admission = DestinationAdmission(
        ledger=SlowLedger(clock, FreeCosts(clock), destination=destination), publisher=publisher,
        clock=clock, config=AdmissionConfig(destination=destination, queue="q", params=params),
        observer=recorder,
    )  # fmt: skip
    await run_loop(clock, admission, stop, ticks + 1.0)
    return [
        [t - start for tick, t in publisher.releases if tick == start] for start in recorder.starts
    ]


async def test_release_points_shift_from_tick_to_tick_and_between_senders() -> None:
    """A tick releases on one grid of 50 points (20 ms apart at a 1 s tick)
    shifted by less than 20 ms from its start, never before the pacer's offsets
    (100 jobs evenly: one every 10 ms); the shift changes every tick and differs
    between destinations, so two senders do not release in lockstep."""
    grain = 1.0 / 50
    shifts: dict[str, list[float]] = {}
    for destination in ("a", "b"):
        per_tick = await _release_times(destination, ticks=4)
        assert len(per_tick) >= 4
        shifts[destination] = []
        for times in per_tick[:4]:
            assert 50 <= len(times) <= 51  # 100 jobs, two a point; the shift may split the ends
            shift = times[0] % grain
            assert all(abs((t - shift) / grain - round((t - shift) / grain)) < 1e-6 for t in times)
            assert 0.0 <= times[0] < 0.02 + 1e-9
            assert times[-1] < 1.0 + 0.02
            shifts[destination].append(shift)
        assert len({round(x, 6) for x in shifts[destination]}) == 4
    assert all(round(a, 6) != round(b, 6) for a, b in zip(shifts["a"], shifts["b"], strict=True))


class ClosingLedger(SlowLedger):
    """Its destination closes (a Retry-After reported) right after the tick's
    own read of it, before the tick releases anything."""

    def __init__(self, clock: VirtualClock, costs: Costs) -> None:
        super().__init__(clock, costs)
        self.reads = 0

    async def read_destination(
        self, destination: str, *, inflight: bool = False
    ) -> DestinationRow | None:
        row = await super().read_destination(destination, inflight=inflight)
        self.reads += 1
        if self.reads == 1 or row is None:
            return row
        until = self.clock.now() + dt.timedelta(seconds=30)
        return dataclasses.replace(row, cooldown_until=until)


async def test_a_retry_after_reported_after_the_tick_read_stops_its_first_release() -> None:
    clock = VirtualClock()
    ledger = ClosingLedger(clock, FreeCosts(clock))
    publisher = RecordingPublisher(clock, [0.0])
    params = PacingParams(tick_seconds=1.0, initial_rate=100.0, min_rate=100.0, max_rate=100.0)
    admission = DestinationAdmission(
        ledger=ledger, publisher=publisher, clock=clock,
        config=AdmissionConfig(destination="d", queue="q", params=params),
    )  # fmt: skip
    with anyio.fail_after(60):  # real seconds
        async with anyio.create_task_group() as tg:
            tg.start_soon(clock.drive, 2.0)
            result = await admission.run_once()
            tg.cancel_scope.cancel()
    assert result.claimed == 100
    assert (result.offered, result.released) == (0, 100)
    assert publisher.releases == []
    assert len(ledger.released) == 100


class TaskRecordingPublisher(FakePublisher):
    """Records, for each release slice, when it was published and from which
    task (the task itself: an id of a task that ended may be reused)."""

    def __init__(self, clock: VirtualClock, confirm_seconds: float) -> None:
        super().__init__(clock, confirm_seconds=confirm_seconds)
        self.slices: list[tuple[float, asyncio.Task[Any] | None]] = []

    async def publish_many(
        self, jobs: Sequence[ClaimedJob], headers: Sequence[Mapping[str, str]]
    ) -> list[PublishError | None]:
        assert self.clock is not None
        self.slices.append((self.clock.monotonic(), asyncio.current_task()))
        return await super().publish_many(jobs, headers)


async def _tick_slices(confirm_seconds: float) -> list[tuple[float, asyncio.Task[Any] | None]]:
    """The release slices of one tick of 10 jobs at 10/s (one every 0.1 s)."""
    clock = VirtualClock()
    stop = anyio.Event()
    ticks = Ticks(clock, stop, until=0.5)
    publisher = TaskRecordingPublisher(clock, confirm_seconds)
    params = PacingParams(
        tick_seconds=1.0, initial_rate=10.0, min_rate=10.0, max_rate=10.0, max_inflight=10**6
    )
    admission = DestinationAdmission(
        ledger=SlowLedger(clock, FreeCosts(clock)), publisher=publisher, clock=clock,
        config=AdmissionConfig(destination="d", queue="q", params=params), observer=ticks,
    )  # fmt: skip
    await run_loop(clock, admission, stop, 10.0)
    first = ticks.done[0][1]
    assert first.offered == 10
    return publisher.slices[: first.offered]  # one job a slice


async def test_slices_confirmed_before_the_next_one_are_published_by_one_task() -> None:
    slices = await _tick_slices(confirm_seconds=0.01)
    assert len(slices) == 10
    assert len({task for _, task in slices}) == 1


async def test_a_slice_awaiting_its_confirms_never_holds_the_next_one_back() -> None:
    slow = await _tick_slices(confirm_seconds=0.25)  # 2-3 slices await confirms at once
    fast = await _tick_slices(confirm_seconds=0.01)
    assert [at for at, _ in slow] == [at for at, _ in fast]  # the same release points
    assert len({task for _, task in slow}) == 3  # no more tasks than slices awaiting at once


async def test_a_slice_no_task_took_before_the_tick_was_cancelled_is_released() -> None:
    published: list[Sequence[ClaimedJob]] = []

    async def publish(group: Sequence[ClaimedJob]) -> None:
        published.append(group)

    first, second = [job("a", "d")], [job("b", "d"), job("c", "d")]
    slices = _Slices(publish)
    async with anyio.create_task_group() as tg:
        slices.start(tg, first)
        await anyio.wait_all_tasks_blocked()  # published, its task waits for the next
        tg.cancel_scope.cancel()
        slices.start(tg, second)  # that task, cancelled, never takes it
    assert published == [first]
    assert slices.unsent() == [job.ref for job in second]
