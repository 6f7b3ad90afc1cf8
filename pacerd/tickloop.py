"""The tick loop: every tick, the destinations this instance leads that need
it, and nothing for the others.

    each tick:  one wake statement (the active destinations of the usable
                partitions, and those whose next job came due)
                  ─► a tick task for each newly active destination
    each active destination, on the loop's schedule:
                read ─► pacer (pure) ─► claim   (every due one together: planner.py)
                ─► publish across the tick ─► mark ─► save
                        (statements and broker writes shared: batching.py;
                         the slices of ticks planned whole: releases.py)
    quiet for QUIET_TICKS ticks (nothing due, nothing in flight, no new
    outcomes): parked in the ledger, its task and memory gone
    the ledger's notices (notices.py): a destination resumed ticks at once

Every destination's ticks are anchored to the loop's schedule, so the ticks
of all of them start at the same instants and their statements are shared:
a tick costs the same number of statements for 10 destinations as for
10,000. An idle destination costs no statement, no task and no timer; its
pacer state stays in the ledger and is loaded again when it wakes. Work that
becomes due later is found through its destination's ``wake_at`` (one index
scan), never by polling each destination.

Leadership is by partition (``leadership.py``): a destination's task runs
while its partition is usable; a lost lock cancels the partition's ticks at
once (their unpublished claims are released), a handover lets them finish
their tick, and the partition is unlocked once none of them runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING

import anyio
import structlog

from pacerd import pacer
from pacerd.admission import DestinationAdmission, TickResult, run_destination, sleep_until_or_stop
from pacerd.batching import SharedLedger, SharedPublisher
from pacerd.errors import PacerdError
from pacerd.planner import TickPlanner
from pacerd.releases import ReleaseSchedule

if TYPE_CHECKING:
    from collections.abc import Callable

    from pacerd.admission import AdmissionConfig, TickObserver
    from pacerd.clock import Clock
    from pacerd.leadership import Leadership
    from pacerd.ledger import Ledger
    from pacerd.notices import ControlNotices, Notice
    from pacerd.publisher import Broker

log = structlog.get_logger("pacerd.tickloop")

# Quiet ticks in a row before a destination is parked: one tick's outcomes
# may still be on their way when the next one finds nothing to do.
QUIET_TICKS = 2


@dataclass(slots=True)
class _Active:
    admission: DestinationAdmission
    partition: int
    scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)
    last_pass: float = 0.0

    def due_since(self) -> float:
        """Since when its next pass is due: its last pass, or the schedule's
        tick before the next one its plan set (later when a sparse plan
        skipped ticks that would send nothing)."""
        planned = self.admission.next_deadline
        if planned is None:
            return self.last_pass
        return max(self.last_pass, planned - self.admission.config.params.tick_seconds)


def is_quiet(result: TickResult) -> bool:
    """Nothing claimed, nothing in flight, no outcomes since the last tick,
    and not held: a paused destination stays in view (status and metrics
    say it is paused) until it is resumed, and a cool-down or a broker
    backoff ends by itself."""
    return (
        result.skipped is None
        and result.claimed == 0
        and result.inflight == 0
        and result.accepted + result.refused == 0
    )


class TickLoop:
    """One per instance: wakes, runs and parks the destinations it leads."""

    def __init__(
        self,
        *,
        ledger: Ledger,
        broker: Broker,
        clock: Clock,
        leadership: Leadership,
        admission_config: Callable[[str], AdmissionConfig],
        route: Callable[[str], tuple[str, str] | None],
        observer: TickObserver,
        is_paused_locally: Callable[[], bool],
        stop: anyio.Event,
        tick_seconds: Callable[[], float],
        forget: Callable[[str], None],
        grace_seconds: float = math.inf,
        notices: ControlNotices | None = None,
    ) -> None:
        self.ledger = ledger
        self.notices = notices  # pauses, resumes and cool-downs as they commit
        # while they are heard, the release slices' closed checks need no polling
        self.shared = SharedLedger(
            ledger, clock=clock, noticed=lambda: notices is not None and notices.connected
        )
        self.broker = broker
        self.publisher = SharedPublisher(broker)  # the admissions' releases, written together
        self.planner = TickPlanner(self.shared, clock=clock)  # their ticks, planned together
        self.releases = ReleaseSchedule(self.publisher, clock)  # their slices, released together
        self.clock = clock
        self.leadership = leadership
        self.admission_config = admission_config
        self.route = route  # (routing key, queue) to declare, or None: not admitted
        self.observer = observer
        self.is_paused_locally = is_paused_locally
        self.stop = stop
        self.tick_seconds = tick_seconds
        self.forget = forget
        self.grace_seconds = grace_seconds
        if notices is not None:
            notices.on_notice = self.notice
        self.ended = anyio.Event()  # set when ``run`` has returned
        self.active: dict[str, _Active] = {}
        self.seen: dict[str, int] = {}  # every destination run here, and its partition
        self._ended = anyio.Event()  # set when a destination's task ends
        self.last_pass = clock.monotonic()
        self.passes = 0

    # -- the loop ----------------------------------------------------------------------

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Runs until ``stop``; then waits for every tick in progress to end
        (each stops at its next release slice, its confirms drained and its
        unpublished claims released); past ``grace_seconds`` after ``stop``,
        the ticks are cancelled (and still release). ``ended`` is set on return."""
        try:
            with anyio.CancelScope() as scope:
                await self._run(scope, task_status)
        finally:
            self.ended.set()

    async def _run(self, scope: anyio.CancelScope, task_status: anyio.abc.TaskStatus[None]) -> None:
        async def grace() -> None:
            await self.stop.wait()
            for entry in list(self.active.values()):
                entry.admission.interrupt()  # its sleep between ticks
            scope.deadline = anyio.current_time() + self.grace_seconds

        async with anyio.create_task_group() as tg:
            tg.start_soon(self._cancel_lost)
            tg.start_soon(grace)
            tg.start_soon(self.planner.run)
            await tg.start(self.releases.run)
            if self.notices is not None:
                await tg.start(self.notices.run)
            task_status.started()
            grid = self.clock.monotonic()
            while not self.stop.is_set():
                try:
                    await self._pass(tg, grid)
                except PacerdError as exc:
                    log.warning("tick_loop_pass_failed", error=str(exc))
                self.last_pass = self.clock.monotonic()
                following = pacer.next_deadline(grid, self.clock.monotonic(), self.tick_seconds())
                wake = following
                settles = self.leadership.next_usable_at()
                if settles is not None:  # a partition taken meanwhile: lead it when it settles
                    wake = min(wake, settles)
                await sleep_until_or_stop(self.clock, wake, self.stop)
                if self.clock.monotonic() >= following:
                    grid = following
            while self.active:
                await self._ended.wait()
            tg.cancel_scope.cancel()

    async def _pass(self, tg: anyio.abc.TaskGroup, grid: float) -> None:
        self.passes += 1
        running = {a.partition for a in self.active.values()}
        for partition in sorted(self.leadership.releasing() - running):
            await self.leadership.hand_over(self.ledger, partition)
        if not self.broker.connected:
            return
        partitions = self.leadership.usable_partitions()
        woken = await self.ledger.wake_destinations(partitions)
        fresh: dict[str, int] = {}
        for destination, partition in woken:
            if destination in self.active:
                continue
            route = self.route(destination)
            if route is None:
                continue
            routing_key, queue = route
            try:  # a no-op once declared on this connection
                await self.broker.declare_destination(routing_key, queue)
            except PacerdError as exc:
                log.error("declare_failed", destination=destination, queue=queue, error=str(exc))
                continue
            fresh[destination] = partition
        # Woken with nothing due and nothing in flight (new, or its work
        # cancelled meanwhile): parked again at once, in one statement,
        # without a task or a tick.
        parked = await self.ledger.park_destinations(list(fresh)) if fresh else set()
        for destination, partition in fresh.items():
            if destination not in parked:
                self._start(tg, destination, partition, grid)

    def _start(
        self, tg: anyio.abc.TaskGroup, destination: str, partition: int, grid: float
    ) -> None:
        admission = DestinationAdmission(
            ledger=self.shared,
            publisher=self.publisher,
            clock=self.clock,
            config=self.admission_config(destination),
            observer=self.observer,
            is_paused_locally=self.is_paused_locally,
            anchor=grid,
            releases=self.releases,
        )
        entry = _Active(admission=admission, partition=partition, last_pass=self.clock.monotonic())
        self.active[destination] = entry
        self.seen[destination] = partition
        tg.start_soon(self._run_destination, destination, entry)

    async def _run_destination(self, destination: str, entry: _Active) -> None:
        quiet = 0
        parked = False  # ended because it was parked (else: not led, or stopping)

        def leads() -> bool:
            return self.broker.connected and self.leadership.usable(entry.partition)

        def on_pass() -> None:
            entry.last_pass = self.clock.monotonic()

        async def until(result: TickResult | None) -> bool:
            nonlocal quiet, parked
            if not leads():
                return True  # handed over, lost, or the broker gone: woken again later
            if result is None:
                quiet = 0
                return False
            if result.skipped == "unknown":
                return True
            quiet = quiet + 1 if is_quiet(result) else 0
            if quiet < QUIET_TICKS:
                return False
            quiet = 0
            try:
                parked = await self.shared.park(destination)
                return parked
            except PacerdError as exc:
                log.warning("park_failed", destination=destination, error=str(exc))
                return False

        log.debug("destination_active", destination=destination, partition=entry.partition)
        try:
            with entry.scope:
                await run_destination(
                    entry.admission, leads=leads, stop=self.stop, on_pass=on_pass, until=until,
                    sleep_until=self.clock.sleep_until,
                    wait_planned=partial(self.planner.wait, entry.admission, leads),
                )  # fmt: skip
        finally:
            await entry.admission.drop_ready()
            self.active.pop(destination, None)
            self.forget(destination)
            log.debug("destination_inactive", destination=destination, parked=parked)
            ended, self._ended = self._ended, anyio.Event()
            ended.set()

    # -- notices -----------------------------------------------------------------------

    def notice(self, notice: Notice) -> None:
        """A destination (None: every one) opened or closed: the release
        slices' closed checks read again, and a destination that its last
        tick found paused ticks again at once (a reopening)."""
        opened, destination = notice
        self.shared.closed_changed()
        if opened:
            self.wake(destination)

    def wake(self, destination: str | None = None) -> int:
        """Reopens now the destinations (every one when None) whose last
        tick found them closed; how many."""
        if destination is None:
            entries = list(self.active.values())
        else:
            entries = [e for e in (self.active.get(destination),) if e is not None]
        return sum(entry.admission.wake() for entry in entries)

    async def _cancel_lost(self) -> None:
        """Cancels, mid-tick, the ticks of every partition whose lock may no
        longer be ours (someone else may lead it soon); keeps the lease renewed."""
        locks = self.leadership.locks
        while True:
            for destination, entry in list(self.active.items()):
                if not self.leadership.has_lock(entry.partition) and not entry.scope.cancel_called:
                    log.warning(
                        "leadership_lost", destination=destination, partition=entry.partition
                    )
                    entry.scope.cancel()
            await locks.keep()

    # -- health and reload -------------------------------------------------------------

    def healthy(self, limit_seconds: float) -> bool:
        """The loop and every active destination passed within ``limit_seconds``
        (of its last pass, or of the tick before the one its plan skipped to:
        a sparse plan leaves out the ticks that would send nothing)."""
        now = self.clock.monotonic()
        if now - self.last_pass > limit_seconds:
            return False
        return all(now - a.due_since() <= limit_seconds for a in self.active.values())

    def reconfigure(self) -> None:
        for destination, entry in self.active.items():
            entry.admission.update_config(self.admission_config(destination))
