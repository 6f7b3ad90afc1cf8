"""A destination that opens between two ticks, in virtual time: its
cool-down runs out, or it is resumed. It releases from then on at its rate
(a reopening tick, ``pacer.tick_budget``), not from its next tick on, and
the tick after the reopening still releases a whole tick."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import anyio
from support.fakes import FakeLedger, FakePublisher, VirtualClock

from pacerd import pacer
from pacerd.admission import (
    CLOSED_CHECK_SECONDS,
    REOPEN_MARGIN_SECONDS,
    AdmissionConfig,
    DestinationAdmission,
)
from pacerd.admission import run_destination as run
from pacerd.pacer import Demand, OutcomeWindow, PacerState, PacingParams

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Sequence

    from pacerd.models import ClaimedJob

RATE = 20.0  # jobs a second (initial and highest: the rate does not move)
OPENS_AT = 1.3  # seconds after the start; ticks fall on whole seconds
END = 3.0


async def _releases(
    close: Callable[[FakeLedger], None], open_: Callable[[FakeLedger, DestinationAdmission], None]
) -> list[float]:
    """The time of every job released, closed at 0 and opened at ``OPENS_AT``."""
    clock = VirtualClock()
    ledger = FakeLedger(clock)
    ledger.add_destination("d", overdue=None)
    close(ledger)
    released: list[float] = []

    def confirmed(jobs: Sequence[ClaimedJob]) -> None:
        released.extend(clock.monotonic() for _ in jobs)

    # reopened at the rate it closed at (a cool-down's end resumes at a fraction)
    params = PacingParams(
        tick_seconds=1.0, initial_rate=RATE, max_rate=RATE, ceiling_resume_fraction=1.0
    )
    admission = DestinationAdmission(
        ledger=ledger, clock=clock, publisher=FakePublisher(clock, on_confirmed=confirmed),
        config=AdmissionConfig(destination="d", queue="q", params=params),
    )  # fmt: skip
    stop = anyio.Event()

    async def at(t: float, then: Callable[[], Awaitable[None] | None]) -> None:
        await clock.sleep_until(t)
        await anyio.lowlevel.checkpoint()
        then()

    with anyio.fail_after(60):  # real seconds
        async with anyio.create_task_group() as tg:
            tg.start_soon(clock.drive, END + 1.0)
            tg.start_soon(at, OPENS_AT, lambda: open_(ledger, admission))
            tg.start_soon(at, END, stop.set)
            await run(admission, stop=stop)
            tg.cancel_scope.cancel()
    return [t for t in released if t < END]


def _check(released: list[float]) -> None:
    assert all(t >= OPENS_AT for t in released), released[:3]
    # the first release right after the opening, not at the next tick (2.0)
    assert released
    assert released[0] <= OPENS_AT + REOPEN_MARGIN_SECONDS + 1.0 / RATE, released[0]
    before_tick = sum(t < 2.0 for t in released)
    # the rest of that tick, from the opening (a cool-down's a margin after its end)
    left = 2.0 - OPENS_AT
    assert int(RATE * (left - REOPEN_MARGIN_SECONDS)) <= before_tick <= int(RATE * left)
    assert sum(t >= 2.0 for t in released) == RATE  # and the next tick a whole one


async def test_a_cool_down_that_runs_out_mid_tick_releases_from_its_end() -> None:
    released = await _releases(
        lambda ledger: ledger.cool_down("d", OPENS_AT), lambda _ledger, _admission: None
    )
    _check(released)


async def test_a_destination_resumed_mid_tick_releases_at_once_when_woken() -> None:
    def resume(ledger: FakeLedger, admission: DestinationAdmission) -> None:
        ledger.pause("d", paused=False)
        assert admission.wake()  # what the tick loop does on the ledger's notice

    released = await _releases(lambda ledger: ledger.pause("d"), resume)
    _check(released)


async def test_a_wake_of_an_open_destination_changes_nothing() -> None:
    clock = VirtualClock()
    ledger = FakeLedger(clock)
    ledger.add_destination("d", overdue=None)
    admission = DestinationAdmission(
        ledger=ledger, clock=clock, publisher=FakePublisher(clock),
        config=AdmissionConfig(destination="d", queue="q", params=PacingParams()),
    )  # fmt: skip
    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            tg.start_soon(clock.drive, 2.0)
            await admission.run_once()
            tg.cancel_scope.cancel()
    assert not admission.closed
    assert not admission.wake()
    assert not admission.woken


async def test_a_tick_closed_mid_tick_tells_the_pacer_how_long_it_was_open() -> None:
    clock = VirtualClock()
    ledger = FakeLedger(clock)
    ledger.add_destination("d", overdue=None)
    released: list[float] = []
    demands: list[Demand | None] = []

    def confirmed(jobs: Sequence[ClaimedJob]) -> None:
        released.extend(clock.monotonic() for _ in jobs)

    def law(state: PacerState, window: OutcomeWindow, demand: Demand | None, **kw: Any) -> Any:
        demands.append(demand)
        return pacer.plan_tick(state, window, demand, **kw)

    params = PacingParams(tick_seconds=1.0, initial_rate=RATE, max_rate=RATE)
    admission = DestinationAdmission(
        ledger=ledger, clock=clock, publisher=FakePublisher(clock, on_confirmed=confirmed),
        config=AdmissionConfig(destination="d", queue="q", params=params), law=law,
    )  # fmt: skip
    stop = anyio.Event()

    async def close_then_stop() -> None:
        await clock.sleep_until(0.4)  # a Retry-After heard 0.4 s into the first tick
        ledger.cool_down("d", 5.0)
        await clock.sleep_until(2.5)
        stop.set()

    with anyio.fail_after(60):  # real seconds
        async with anyio.create_task_group() as tg:
            tg.start_soon(clock.drive, 3.0)
            tg.start_soon(close_then_stop)
            await run(admission, stop=stop)
            tg.cancel_scope.cancel()
    first, after = demands[0], demands[1]
    assert first is None
    assert after is not None
    assert after.open_seconds is not None
    assert 0.4 <= after.open_seconds <= 0.4 + CLOSED_CHECK_SECONDS + 1.0 / RATE
    assert after.sent == len(released) == sum(t < 0.4 for t in released) > 0
    # the ticks after it, closed from their start, closed nothing mid-tick
    assert len(demands) >= 3
    assert demands[2] is not None
    assert demands[2].open_seconds is None
