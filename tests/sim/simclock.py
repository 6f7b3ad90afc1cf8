"""Virtual time for code that sleeps through ``pacerd.clock.Clock``, on trio.

``SimTime`` is the one virtual timeline of a run: every sleeper waits in a
heap (trio's lowest-level park and reschedule, no timer and no event object),
and time moves only when the driver says so — typically after
``trio.testing.wait_all_tasks_blocked()``, to the earliest sleeper or model
event. ``SimClock`` is one host's view of it (``pacerd.clock.Clock``): its
monotonic clock is the virtual time plus an offset, its wall clock is shared.
"""

from __future__ import annotations

import datetime as dt
import heapq
import math
from typing import Any

import trio

EPOCH_AT = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)  # the wall time at virtual time 0


class SimTime:
    def __init__(self) -> None:
        self.t = 0.0
        self._sleepers: list[list[Any]] = []  # [deadline, seq, task or None (cancelled)]
        self._seq = 0

    async def sleep_until(self, t: float) -> None:
        """Parks the current task until the virtual time reaches ``t``."""
        if t <= self.t:
            await trio.lowlevel.checkpoint()
            return
        self._seq += 1
        entry = [t, self._seq, trio.lowlevel.current_task()]
        heapq.heappush(self._sleepers, entry)

        def abort(_: object) -> trio.lowlevel.Abort:
            entry[2] = None  # cancelled: left in the heap, skipped when due
            return trio.lowlevel.Abort.SUCCEEDED

        await trio.lowlevel.wait_task_rescheduled(abort)

    def next_wake(self) -> float:
        """The earliest deadline of a sleeper still waiting (inf: none)."""
        sleepers = self._sleepers
        while sleepers and sleepers[0][2] is None:
            heapq.heappop(sleepers)
        return sleepers[0][0] if sleepers else math.inf

    def wake(self, t: float) -> None:
        """Moves the time to ``t`` and reschedules every sleeper due by then."""
        self.t = t
        sleepers = self._sleepers
        while sleepers and sleepers[0][0] <= t:
            task = heapq.heappop(sleepers)[2]
            if task is not None:
                trio.lowlevel.reschedule(task)


class SimClock:
    """``pacerd.clock.Clock`` on a ``SimTime``: one host's monotonic clock."""

    def __init__(self, time: SimTime, *, offset: float = 0.0) -> None:
        self.time = time
        self.offset = offset

    def monotonic(self) -> float:
        return self.time.t + self.offset

    def now(self) -> dt.datetime:
        return EPOCH_AT + dt.timedelta(seconds=self.time.t)

    async def sleep_until(self, deadline: float) -> None:
        await self.time.sleep_until(deadline - self.offset)

    async def sleep(self, seconds: float) -> None:
        await self.time.sleep_until(self.time.t + max(0.0, seconds))
