"""The simulation's seams held to the contracts the real ones pass
(``support.ledger_contract``, ``support.clock_contract``): the ledger view
over a ``SimLedger`` and the trio ``SimClock``. (Its publisher is the shared
``FakePublisher``, held to its contract in ``tests/contract``.)"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import pytest
import trio
import trio.testing
from simclock import SimClock, SimTime
from simdriver import SimAdmissionLedger
from simlib import Job, LedgerSpec, SimLedger
from support.clock_contract import ClockContract
from support.ledger_contract import DEST, WINDOW, LedgerContract

if TYPE_CHECKING:
    from support.clock_contract import Case, Run

    from pacerd.models import JobRef


class SimDriver:
    def __init__(self) -> None:
        self.time = SimTime()
        self.time.t = 1000.0
        self.model = SimLedger(LedgerSpec(backlog=0))
        self.ledger = SimAdmissionLedger(
            self.model, self.time, None, destination=DEST, live_window_seconds=WINDOW
        )

    async def schedule(self, job_id: str, *, ago: float) -> None:
        job = Job(job_id, self.time.t - ago, live=True, orig=False)
        # not yet due: waiting; due: a live candidate (moved to the backlog once old)
        heap = self.model.future if ago < 0 else self.model.live
        self.model._push(heap, job)

    async def report(
        self, ref: JobRef, *, accepted: bool, retry_after_s: float | None = None
    ) -> None:
        job = self.model.claimed[ref.job_id]
        assert self.model.report(job, ref.attempt, self.time.t, accepted, retry_after_s)


class TestSimLedger(LedgerContract):
    @pytest.fixture
    def driver(self) -> SimDriver:
        return SimDriver()


def _on_sim_time(case: Case) -> None:
    async def main() -> None:
        time = SimTime()
        with trio.fail_after(10):  # real seconds
            async with trio.open_nursery() as nursery:

                async def drive() -> None:
                    while True:
                        await trio.testing.wait_all_tasks_blocked()
                        if (wake := time.next_wake()) < math.inf:
                            time.wake(wake)

                nursery.start_soon(drive)
                await case(SimClock(time, offset=1000.0))
                nursery.cancel_scope.cancel()

    trio.run(main)


class TestSimClock(ClockContract):
    @pytest.fixture
    def run(self) -> Run:
        return _on_sim_time
