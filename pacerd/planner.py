"""The tick planner: the ticks of every destination due at one instant,
read, planned and first claimed together, in one task.

    the planner's one timer (the earliest tick waiting)
      ─► one read of every due destination's row and in-flight count
      ─► the pacer of each (pure: ``DestinationAdmission.begin``)
      ─► one save of the epochs of the cuts ─► one claim for every budget
      ─► each destination's task goes on with its tick: its releases across
         the tick, its marks and its state saved (``admission.py``)

Between its ticks, a destination's task waits here (``wait``, which the tick
loop gives ``run_destination`` for its sleep between ticks) instead of on a
timer of its own. With a thousand active destinations, their planning no
longer goes through the event loop a thousand tasks at a time, once for the
read and once for the claim, behind the releases of the tick before: it is
the statements and one pass of pure code.

A task woken before its tick (a resume reopening it, the stop) leaves and
ticks by itself, as does its first tick and a reopening at the end of a
cool-down (``run_destination``). A task that leaves while its tick is being
planned (its leadership lost, the stop) gets nothing: what was claimed for
it is released at once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import anyio
import structlog

from pacerd.admission import Begun, Planned
from pacerd.errors import PacerdError
from pacerd.models import ClaimRequest

if TYPE_CHECKING:
    from collections.abc import Callable

    from pacerd.admission import DestinationAdmission
    from pacerd.batching import SharedLedger
    from pacerd.clock import Clock
    from pacerd.models import ClaimedJob

log = structlog.get_logger("pacerd.planner")


@dataclass(eq=False, slots=True)
class _Waiter:
    admission: DestinationAdmission
    deadline: float
    leads: Callable[[], bool]
    done: anyio.Event = field(default_factory=anyio.Event)
    gone: bool = False  # its task left before ``done`` (woken early, or cancelled)


class TickPlanner:
    """One per tick loop: plans together the ticks that come due together."""

    def __init__(self, ledger: SharedLedger, *, clock: Clock) -> None:
        self.ledger = ledger
        self.clock = clock
        self._waiting: list[_Waiter] = []
        self._next = math.inf  # when the planner wakes next
        self._changed = anyio.Event()  # a tick due before that
        self.passes = 0  # passes run (tests, the bench)

    async def wait(
        self, admission: DestinationAdmission, leads: Callable[[], bool], deadline: float
    ) -> None:
        """Until ``admission``'s tick due at ``deadline`` is planned (its
        ``ready`` set, unless it is not led then). Cancelled (woken early,
        or its leadership lost), it leaves, and its tick is not planned or,
        if it was being planned, gets nothing (its claim is released)."""
        waiter = _Waiter(admission, deadline, leads)
        self._waiting.append(waiter)
        if deadline < self._next:
            self._changed.set()
        try:
            await waiter.done.wait()
        except BaseException:
            waiter.gone = True
            raise

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Plans the ticks as they come due, until cancelled."""
        task_status.started()
        while True:
            self._waiting = [w for w in self._waiting if not w.gone]
            self._changed = anyio.Event()
            self._next = min((w.deadline for w in self._waiting), default=math.inf)
            if self._next > self.clock.monotonic():
                await self._sleep(self._next)
            now = self.clock.monotonic()
            due = [w for w in self._waiting if w.deadline <= now and not w.gone]
            if due:
                self._waiting = [w for w in self._waiting if w.deadline > now and not w.gone]
                self._next = math.inf  # a tick due meanwhile wakes the next pass at once
                await self._pass(due, now)

    async def _sleep(self, deadline: float) -> None:
        """Until ``deadline``, or a tick due before it waits."""
        async with anyio.create_task_group() as tg:

            async def changed() -> None:
                await self._changed.wait()
                tg.cancel_scope.cancel()

            tg.start_soon(changed)
            if math.isinf(deadline):
                await anyio.sleep_forever()
            await self.clock.sleep_until(deadline)
            tg.cancel_scope.cancel()

    async def _pass(self, due: list[_Waiter], now: float) -> None:
        self.passes += 1
        led = [w for w in due if w.leads()]  # the others wake to find they do not lead
        claimed: dict[str, list[ClaimedJob]] = {}
        planned: dict[_Waiter, Begun | None] = {}
        failed: PacerdError | None = None
        try:
            names = [w.admission.config.destination for w in led]
            rows = await self.ledger.read_rows(names) if led else {}
            for waiter, name in zip(led, names, strict=True):
                if waiter.gone:
                    continue
                try:
                    planned[waiter] = waiter.admission.begin(rows.get(name), now)
                except PacerdError as exc:
                    waiter.admission.ready = Planned(error=exc)
            saves = [
                (w.admission.config.destination, b.epoch_state, w.admission.epoch)
                for w, b in planned.items()
                if b is not None and b.epoch_state is not None
            ]
            if saves:
                await self.ledger.save_states(saves)
            claims = [  # not for a task gone meanwhile, or a destination no longer led
                self._request(w, b)
                for w, b in planned.items()
                if b is not None and b.limit > 0 and not w.gone and w.leads()
            ]
            if claims:
                with anyio.CancelScope(shield=True):  # claimed: handed on or released
                    claimed = await self.ledger.claim_many(claims)
        except PacerdError as exc:
            failed = exc
            log.warning("tick_planning_failed", destinations=len(led), error=str(exc))
        seconds = self.clock.monotonic() - now
        abandoned: list[ClaimedJob] = []
        for waiter, begun in planned.items():
            name = waiter.admission.config.destination
            # None when not claimed for (not led just then): if it ticks, it claims itself
            jobs = claimed.pop(name, None) if begun is not None and begun.limit > 0 else None
            if waiter.gone:
                abandoned.extend(jobs or ())
            elif failed is None:
                waiter.admission.ready = Planned(begun=begun, jobs=jobs, planning_seconds=seconds)
        if failed is not None:  # every tick it served fails (one that failed alone kept its error)
            for waiter in led:
                if not waiter.gone and waiter.admission.ready is None:
                    waiter.admission.ready = Planned(error=failed)
        for waiter in due:
            waiter.done.set()
        if abandoned:
            with anyio.CancelScope(shield=True):
                await self.ledger.release_abandoned(abandoned)

    @staticmethod
    def _request(waiter: _Waiter, begun: Begun) -> tuple[ClaimRequest, str]:
        admission = waiter.admission
        cfg = admission.config
        live_limit, limit = admission.first_chunk(begun)
        request = ClaimRequest(
            destination=cfg.destination, live_limit=live_limit, limit=limit,
            claim_seconds=cfg.claim_seconds, epoch=admission.epoch,
            live_window_seconds=cfg.params.live_window_seconds,
        )  # fmt: skip
        return request, cfg.instance
