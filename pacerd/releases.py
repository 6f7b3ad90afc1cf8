"""The release schedule: the release slices of many destinations' ticks,
published at their release points by one task, the slices due together in
one publish.

    a tick whose slices are all known at its start (``admission.py``)
      ─► its slices (release point, jobs) into the schedule's one heap
    the schedule's one timer (the earliest slice)
      ─► every slice due within ``GATHER_SECONDS``: each tick's stop and
         closed checks ─► one ``publish_many`` for all of them (each slice in
         its own publish span) ─► each tick sorts its confirms, marks them
      ─► the tick's task wakes once, when its last slice is settled

With a thousand active destinations releasing a job or two each a tick, a
release slice in each tick's own task cost a timer, a task step and a
confirm wait of its own; here they cost one of each for all the slices of
an instant. A tick that the pacer may brake mid-tick, or one claimed in
chunks, reshapes its slices as it goes and keeps releasing them itself.

The tick (``ScheduledTick``, admission's) decides what its slices become:
the schedule asks it whether a slice may go, publishes, and hands it the
results. A slice the tick no longer expects (it ended early, or its task
left) is skipped.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
from typing import TYPE_CHECKING, Any, Protocol

import anyio

from pacerd.admission import sleep_until_or_stop

if TYPE_CHECKING:
    from collections.abc import Callable, Coroutine, Mapping, Sequence
    from contextlib import AbstractContextManager

    from pacerd.clock import Clock
    from pacerd.errors import PublishError
    from pacerd.models import ClaimedJob
    from pacerd.publisher import Publisher

# Slices due within this much of the earliest go out with it: release points
# of different destinations lie on grids shifted by up to 20 ms
# (``admission.PHASE_SPAN_SECONDS``), and a few milliseconds early is well
# within one tick's spacing at the rates where many slices meet.
GATHER_SECONDS = 0.004


class SlicedTick(Protocol):
    """What the schedule needs of a tick (``admission.ScheduledTick``)."""

    async def may_release(self, index: int) -> bool:
        """Whether slice ``index`` goes out now (False: skipped; the tick
        has accounted for it)."""
        ...

    def publish_span(self, index: int) -> AbstractContextManager[Mapping[str, str]]:
        """Around the publish of slice ``index``: its messages' headers."""
        ...

    def published(self, index: int, results: Sequence[PublishError | None]) -> None:
        """Slice ``index``'s results, in order (None: confirmed)."""
        ...

    def lost(self, index: int) -> None:
        """Slice ``index``'s publish was interrupted: its jobs are not sent."""
        ...


class ReleaseSchedule:
    """One per tick loop: publishes the slices of its ticks on time."""

    def __init__(self, publisher: Publisher, clock: Clock) -> None:
        self.publisher = publisher
        self.clock = clock
        self._heap: list[tuple[float, int, SlicedTick, int, Sequence[ClaimedJob]]] = []
        self._order = itertools.count()  # ties keep the order slices were added
        self._changed = anyio.Event()  # a slice due before the timer's deadline
        self._tg: anyio.abc.TaskGroup | None = None
        self.publishes = 0  # publish_many calls made (tests, the bench)

    @property
    def running(self) -> bool:
        return self._tg is not None

    def add(self, tick: SlicedTick, slices: Sequence[tuple[float, Sequence[ClaimedJob]]]) -> None:
        """``tick``'s slices, each (release point on the clock, its jobs),
        indexed in order from 0."""
        earliest = self._heap[0][0] if self._heap else None
        for index, (at, jobs) in enumerate(slices):
            heapq.heappush(self._heap, (at, next(self._order), tick, index, jobs))
        if self._heap and (earliest is None or self._heap[0][0] < earliest):
            self._changed.set()

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Releases slices as they come due, until cancelled."""
        async with anyio.create_task_group() as tg:
            self._tg = tg
            task_status.started()
            try:
                while True:
                    self._changed = anyio.Event()
                    if not self._heap:
                        await self._changed.wait()
                        continue
                    if self._heap[0][0] > self.clock.monotonic():
                        await sleep_until_or_stop(self.clock, self._heap[0][0], self._changed)
                        continue
                    horizon = self.clock.monotonic() + GATHER_SECONDS
                    due = []
                    while self._heap and self._heap[0][0] <= horizon:
                        _at, _, tick, index, jobs = heapq.heappop(self._heap)
                        due.append((tick, index, jobs))
                    tg.start_soon(self._release, due)
            finally:
                self._tg = None

    async def _release(self, due: list[tuple[SlicedTick, int, Sequence[ClaimedJob]]]) -> None:
        going = [(tick, index, jobs) for tick, index, jobs in due if await tick.may_release(index)]
        if not going:
            return
        jobs: list[ClaimedJob] = []
        headers: list[Mapping[str, Any]] = []
        try:
            with contextlib.ExitStack() as spans:
                for tick, index, group in going:
                    slice_headers = spans.enter_context(tick.publish_span(index))
                    jobs.extend(group)
                    headers.extend([slice_headers] * len(group))
                self.publishes += 1
                results = await self.publisher.publish_many(jobs, headers)
        except BaseException:
            for tick, index, _ in going:
                tick.lost(index)
            raise
        start = 0
        for tick, index, group in going:
            tick.published(index, results[start : start + len(group)])
            start += len(group)

    def start_soon(self, task: Callable[[], Coroutine[Any, Any, None]]) -> None:
        """Runs ``task()`` in the schedule's task group (a tick's mark
        after a slice's confirms: off the release schedule)."""
        assert self._tg is not None
        self._tg.start_soon(task)
