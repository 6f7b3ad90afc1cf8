"""A rig for admission's tick in virtual time: a clock that moves to the next
sleeper's deadline only when every task is waiting, a ledger and a publisher
whose operations cost virtual time, and a recorder of ticks. pacerd's own
admission code runs on it, exactly and in no real time."""

from __future__ import annotations

import contextlib
import datetime as dt
import heapq
from typing import TYPE_CHECKING, Any

import anyio
import anyio.lowlevel

from pacerd.admission import DestinationAdmission, TickResult, run_destination
from pacerd.models import ClaimedJob, DestinationRow, JobRef

if TYPE_CHECKING:
    from collections.abc import Iterator, Sequence

    from pacerd.errors import PublishError

LOOP_SECONDS = 0.002  # the event loop's own work per operation (serial)
WAIT_SECONDS = 0.003  # the round trip per operation (concurrent)


class VirtualClock:
    """``pacerd.clock.Clock`` in virtual time: ``drive`` lets every task run until
    it waits, then moves the time to the earliest sleeper's deadline."""

    def __init__(self) -> None:
        self._mono = 0.0
        self._sleepers: list[tuple[float, int, anyio.Event]] = []
        self._count = 0

    def monotonic(self) -> float:
        return self._mono

    def now(self) -> dt.datetime:
        return dt.datetime(2026, 1, 1, tzinfo=dt.UTC) + dt.timedelta(seconds=self._mono)

    async def sleep_until(self, deadline: float) -> None:
        if deadline <= self._mono:
            await anyio.lowlevel.checkpoint()
            return
        woken = anyio.Event()
        self._count += 1
        heapq.heappush(self._sleepers, (deadline, self._count, woken))
        await woken.wait()

    async def sleep(self, seconds: float) -> None:
        await self.sleep_until(self._mono + max(0.0, seconds))

    async def drive(self, until: float) -> None:
        while self._mono < until:
            for _ in range(100):  # everything runnable runs (all I/O here is on this clock)
                await anyio.lowlevel.checkpoint()
            if self._sleepers:
                self._mono = max(self._mono, self._sleepers[0][0])
                while self._sleepers and self._sleepers[0][0] <= self._mono:
                    heapq.heappop(self._sleepers)[2].set()


class Costs:
    """What one operation costs: a turn of the (one) event loop, then a wait."""

    def __init__(self, clock: VirtualClock) -> None:
        self.clock = clock
        self.loop = anyio.Lock()

    async def operation(self, count: int = 1) -> None:
        """``count`` operations pipelined: each takes its turn of the loop,
        then they wait for the other side together."""
        async with self.loop:
            await self.clock.sleep(LOOP_SECONDS * count)
        await self.clock.sleep(WAIT_SECONDS)


class SlowLedger:
    """The ledger operations a tick needs, each costing one operation."""

    def __init__(self, clock: VirtualClock, costs: Costs) -> None:
        self.clock, self.costs = clock, costs
        self.claimed = 0
        self.state: dict[str, Any] | None = None

    async def _io(self) -> None:
        await self.costs.operation()

    async def read_destination(self, destination: str) -> DestinationRow:
        await self._io()
        return DestinationRow(
            destination=destination, paused=False, paused_all=False, cooldown_until=None,
            epoch=0, pacer_state=self.state, n_accepted=0, n_refused=0, n_accepted_fresh=0,
            n_refused_fresh=0, n_retry_after=0, leader=None, leader_since=None,
            now=self.clock.now(),
        )  # fmt: skip

    async def count_inflight(self, destination: str) -> int:
        await self._io()
        return 0

    async def has_due(self, destination: str, *, at_least: int = 1) -> int:
        await self._io()
        return at_least

    async def claim_due(self, destination: str, *, limit: int, **_: object) -> list[ClaimedJob]:
        await self._io()
        due = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
        jobs = []
        for _i in range(limit):
            self.claimed += 1
            job = ClaimedJob(
                job_id=f"j{self.claimed}", kind="k", destination=destination, attempt=1,
                revision=0, payload_json="{}", cursor_json=None, eligible_at=due, live=False,
            )  # fmt: skip
            jobs.append(job)
        return jobs

    async def mark_offered(self, refs: Sequence[JobRef], **_: object) -> list[JobRef]:
        await self._io()
        return list(refs)

    async def release_claims(self, refs: Sequence[JobRef], **_: object) -> list[JobRef]:
        await self._io()
        return list(refs)

    async def save_pacer_state(self, destination: str, state: Any, **_: object) -> None:
        await self._io()
        self.state = dict(state)


class BatchPublisher:
    """The ``Publisher`` protocol around a fake's ``publish_many`` (admission
    publishes slices; ``publish`` is one job's slice)."""

    async def declare_destination(self, destination: str, queue: str) -> None:
        return None

    async def publish(self, job: ClaimedJob, headers: object) -> None:
        (error,) = await self.publish_many([job], headers)
        if error is not None:
            raise error

    async def publish_many(
        self, jobs: Sequence[ClaimedJob], headers: object
    ) -> list[PublishError | None]:
        raise NotImplementedError


class Ticks:
    """Records every tick (with the clock's time) and stops the loop after ``until``."""

    def __init__(self, clock: VirtualClock, stop: anyio.Event, until: float) -> None:
        self.clock, self.stop, self.until = clock, stop, until
        self.done: list[tuple[float, TickResult]] = []

    @contextlib.contextmanager
    def _nothing(self, *_args: object, **_kwargs: object) -> Iterator[Any]:
        yield {}

    tick_span = claim_span = publish_span = mark_offered_span = _nothing

    def tick_completed(self, result: TickResult) -> None:
        self.done.append((self.clock.monotonic(), result))
        if self.clock.monotonic() >= self.until:
            self.stop.set()


async def run_loop(
    clock: VirtualClock, admission: DestinationAdmission, stop: anyio.Event, seconds: float
) -> None:
    """``run_destination`` until ``stop``, the virtual clock driven for ``seconds``."""
    with anyio.fail_after(60):  # real seconds
        async with anyio.create_task_group() as tg:
            tg.start_soon(clock.drive, seconds)
            await run_destination(admission, stop=stop)
            tg.cancel_scope.cancel()


class FreeCosts(Costs):
    """Operations that take no time: only the release schedule moves the clock."""

    async def operation(self, count: int = 1) -> None:
        await anyio.lowlevel.checkpoint()
