"""What pacerd relies on from its clock (``clock.Clock``): one body of cases,
run against every implementation. A test module subclasses ``ClockContract``
and gives a ``run`` fixture: it runs a case (an async function of the
clock) to its end on the clock under test, with whatever moves that clock's
time (the real one moves by itself, a virtual one is driven)."""

from __future__ import annotations

import datetime as dt
from typing import TYPE_CHECKING

import anyio

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from pacerd.clock import Clock

    Case = Callable[[Clock], Awaitable[None]]
    Run = Callable[[Case], None]

STEP = 0.05  # seconds: short, for the real clock


async def _monotonic_never_decreases(clock: Clock) -> None:
    seen = [clock.monotonic()]
    for step in (0.0, STEP, -1.0, STEP / 2):
        await clock.sleep(step)
        seen.append(clock.monotonic())
        await clock.sleep_until(seen[-1] - 1.0)  # a deadline passed already
        seen.append(clock.monotonic())
    assert seen == sorted(seen)


async def _sleep_advances_by_at_least_its_duration(clock: Clock) -> None:
    before = clock.monotonic()
    await clock.sleep(STEP)
    assert clock.monotonic() >= before + STEP  # the deadline as the daemon computes one


async def _sleep_until_returns_at_or_after_the_deadline(clock: Clock) -> None:
    deadline = clock.monotonic() + STEP
    await clock.sleep_until(deadline)
    assert clock.monotonic() >= deadline


async def _now_is_aware_utc_and_moves_with_the_clock(clock: Clock) -> None:
    before = clock.now()
    assert before.utcoffset() == dt.timedelta(0)
    await clock.sleep(STEP)
    # a millisecond for the wall clock's resolution against the monotonic one
    assert clock.now() - before >= dt.timedelta(seconds=STEP - 1e-3)


async def _concurrent_sleepers_wake_in_deadline_order(clock: Clock) -> None:
    start = clock.monotonic()
    woke: list[float] = []

    async def sleeper(offset: float) -> None:
        await clock.sleep_until(start + offset)
        assert clock.monotonic() >= start + offset
        woke.append(offset)

    async with anyio.create_task_group() as tg:
        for offset in (3 * STEP, STEP, 2 * STEP):
            tg.start_soon(sleeper, offset)
    assert woke == [STEP, 2 * STEP, 3 * STEP]


class ClockContract:
    def test_monotonic_never_decreases(self, run: Run) -> None:
        run(_monotonic_never_decreases)

    def test_sleep_advances_by_at_least_its_duration(self, run: Run) -> None:
        run(_sleep_advances_by_at_least_its_duration)

    def test_sleep_until_returns_at_or_after_the_deadline(self, run: Run) -> None:
        run(_sleep_until_returns_at_or_after_the_deadline)

    def test_now_is_aware_utc_and_moves_with_the_clock(self, run: Run) -> None:
        run(_now_is_aware_utc_and_moves_with_the_clock)

    def test_concurrent_sleepers_wake_in_deadline_order(self, run: Run) -> None:
        run(_concurrent_sleepers_wake_in_deadline_order)
