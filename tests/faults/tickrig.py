"""A rig for admission's tick in virtual time: the shared fakes
(``support.fakes``: a clock that moves to the next sleeper's deadline only
when every task is waiting, a ledger and a publisher) with operations that
cost virtual time, and a recorder of ticks. pacerd's own admission code runs
on it, exactly and in no real time."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

import anyio
import anyio.lowlevel
from support.fakes import FakeLedger, VirtualClock

from pacerd.admission import DestinationAdmission, TickResult, run_destination

if TYPE_CHECKING:
    from collections.abc import Iterator

LOOP_SECONDS = 0.002  # the event loop's own work per operation (serial)
WAIT_SECONDS = 0.003  # the round trip per operation (concurrent)


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


class SlowLedger(FakeLedger):
    """A ``FakeLedger`` over an endless overdue backlog of ``destination``,
    each operation costing one of ``costs``."""

    def __init__(self, clock: VirtualClock, costs: Costs, *, destination: str = "d") -> None:
        super().__init__(clock, price=costs.operation)
        self.add_destination(destination, overdue=None)


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
