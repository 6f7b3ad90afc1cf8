"""The ledger contract (``support.ledger_contract``) against the real ledger,
on a fresh migrated database, and against ``support.fakes.FakeLedger``. (The
simulation's ledger view runs it in ``tests/sim/test_sim_contract.py``.)"""

from __future__ import annotations

import datetime as dt
from typing import TYPE_CHECKING

import pytest
from support.fakes import FakeLedger
from support.ledger_contract import DEST, LedgerContract

from pacerd.clock import ManualClock, SystemClock

if TYPE_CHECKING:
    from pacerd.ledger import Ledger
    from pacerd.models import JobRef


class RealDriver:
    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger

    async def schedule(self, job_id: str, *, ago: float) -> None:
        await self.ledger.pool.fetchval(
            "SELECT pacerd.schedule(job_id => $1, kind => 'k', destination => $2,"
            " payload => $3::jsonb, eligible_at => $4)",
            job_id, DEST, {}, SystemClock().now() - dt.timedelta(seconds=ago),
        )  # fmt: skip

    async def report(
        self, ref: JobRef, *, accepted: bool, retry_after_s: float | None = None
    ) -> None:
        result = await self.ledger.pool.fetchval(
            "SELECT pacerd.report(job_id => $1, attempt => $2, outcome => $3,"
            " retry_after_s => $4)",
            ref.job_id, ref.attempt, "ok" if accepted else "refused", retry_after_s,
        )  # fmt: skip
        assert result not in ("stale", "unknown"), result


class FakeDriver:
    def __init__(self) -> None:
        self.clock = ManualClock()
        self.ledger = FakeLedger(self.clock)
        self.ledger.add_destination(DEST)

    async def schedule(self, job_id: str, *, ago: float) -> None:
        eligible_at = self.clock.now() - dt.timedelta(seconds=ago)
        self.ledger.schedule(job_id, DEST, eligible_at=eligible_at)

    async def report(
        self, ref: JobRef, *, accepted: bool, retry_after_s: float | None = None
    ) -> None:
        assert self.ledger.report(ref, accepted=accepted, retry_after_s=retry_after_s)


@pytest.mark.services
class TestRealLedger(LedgerContract):
    @pytest.fixture
    async def driver(self, ledger_: Ledger) -> RealDriver:
        await ledger_.ensure_destination(DEST)
        return RealDriver(ledger_)


class TestFakeLedger(LedgerContract):
    @pytest.fixture
    def driver(self) -> FakeDriver:
        return FakeDriver()
