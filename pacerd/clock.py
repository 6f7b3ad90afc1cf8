"""Time, in one place.

``Clock`` is the only way pacerd reads time: ``monotonic()`` for durations and
deadlines, ``now()`` for aware-UTC timestamps, ``sleep_until()`` to wait for a
deadline. ``daemon.py`` builds one clock and hands it to every component;
tests use ``ManualClock``. This is the only module allowed to read the system
clock (ruff TID251 enforces it).
"""

from __future__ import annotations

import datetime as dt
import time
from typing import Protocol

import anyio
import anyio.lowlevel


class Clock(Protocol):
    def monotonic(self) -> float: ...

    def now(self) -> dt.datetime: ...

    async def sleep_until(self, deadline: float) -> None: ...

    async def sleep(self, seconds: float) -> None: ...


class SystemClock:
    """The real clock."""

    def monotonic(self) -> float:
        return time.monotonic()

    def now(self) -> dt.datetime:
        return dt.datetime.now(dt.UTC)

    async def sleep_until(self, deadline: float) -> None:
        await anyio.sleep(max(0.0, deadline - time.monotonic()))

    async def sleep(self, seconds: float) -> None:
        await anyio.sleep(max(0.0, seconds))


class ManualClock:
    """A clock that moves only when told to, or by itself in autojump mode.

    In autojump mode ``sleep_until`` advances the clock to the deadline at once,
    so a loop that sleeps runs through simulated time without real waiting. It
    serves one sleeper at a time: concurrent sleepers wake in the order they
    sleep, not by deadline (``tests/support/fakes.py``'s ``VirtualClock``
    serves many; the contract suite holds both).
    """

    def __init__(
        self,
        *,
        start: float = 0.0,
        start_at: dt.datetime | None = None,
        autojump: bool = False,
    ) -> None:
        self._mono = start
        self._start_mono = start
        self._start_at = start_at or dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
        self.autojump = autojump

    def monotonic(self) -> float:
        return self._mono

    def now(self) -> dt.datetime:
        return self._start_at + dt.timedelta(seconds=self._mono - self._start_mono)

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError("a clock does not run backwards")
        self._mono += seconds

    async def sleep_until(self, deadline: float) -> None:
        if self.autojump:
            if deadline > self._mono:
                self._mono = deadline
            await anyio.lowlevel.checkpoint()
            return
        while self._mono < deadline:
            await anyio.lowlevel.checkpoint()

    async def sleep(self, seconds: float) -> None:
        await self.sleep_until(self._mono + max(0.0, seconds))


def wall_clock_seconds() -> float:
    """Seconds since the epoch, for code outside the daemon (CLI, benchmarks)."""
    return time.time()
