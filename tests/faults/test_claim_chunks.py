"""A tick whose budget is larger than one claim chunk, in virtual time: it
claims in chunks of at most ``CLAIM_CHUNK`` jobs, starts releasing after the
first, stays about one chunk ahead of its releases, and accounts for every
job it claimed — published, or released back — however the tick ends."""

from __future__ import annotations

import dataclasses
import datetime as dt
from typing import TYPE_CHECKING, Any

import anyio
from support.fakes import FakePublisher, VirtualClock
from tickrig import FreeCosts, SlowLedger

from pacerd.admission import CLAIM_CHUNK, AdmissionConfig, DestinationAdmission, TickResult
from pacerd.errors import LedgerUnavailable
from pacerd.pacer import PacingParams

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    from pacerd.errors import PublishError
    from pacerd.models import ClaimedJob, DestinationRow

ROW_SECONDS = 20e-6  # a claim costs 20 ms per 1,000 rows (PostgreSQL's side)
CONFIRM_SECONDS = 0.01


class ChunkLedger(SlowLedger):
    """A backlog of ``backlog`` due jobs; claims cost time per row and are
    recorded (releases too: ``released``); the destination can close at
    ``closes_at``; the ``fail_on``-th claim fails."""

    def __init__(
        self,
        clock: VirtualClock,
        *,
        backlog: int = 10**9,
        closes_at: float | None = None,
        fail_on: int | None = None,
    ) -> None:
        super().__init__(clock, FreeCosts(clock))
        self.backlog, self.closes_at, self.fail_on = backlog, closes_at, fail_on
        self.claims: list[tuple[int, int, float]] = []  # (limit, got, finished at)

    async def read_destination(
        self, destination: str, *, inflight: bool = False
    ) -> DestinationRow | None:
        row = await super().read_destination(destination, inflight=inflight)
        if (
            row is not None
            and self.closes_at is not None
            and self.clock.monotonic() >= self.closes_at
        ):
            return dataclasses.replace(row, cooldown_until=self.clock.now() + dt.timedelta(10))
        return row

    async def claim_due(self, destination: str, *, limit: int, **kw: Any) -> list[ClaimedJob]:
        if self.fail_on is not None and len(self.claims) + 1 == self.fail_on:
            self.claims.append((limit, 0, self.clock.monotonic()))
            raise LedgerUnavailable("the ledger went away")
        take = min(limit, self.backlog - self.claimed)
        await self.clock.sleep(0.002 + take * ROW_SECONDS)
        jobs = await super().claim_due(destination, limit=take, **kw)
        self.claims.append((limit, len(jobs), self.clock.monotonic()))
        return jobs


class ConfirmingPublisher(FakePublisher):
    """Confirms each slice ``CONFIRM_SECONDS`` later (``sent_at``: when slices
    went out); records the most jobs claimed but not yet handed to the broker."""

    def __init__(self, clock: VirtualClock, ledger: ChunkLedger) -> None:
        super().__init__(clock, confirm_seconds=CONFIRM_SECONDS)
        self.ledger = ledger
        self.most_ahead = 0

    async def publish_many(
        self, jobs: Sequence[ClaimedJob], headers: Sequence[Mapping[str, str]]
    ) -> list[PublishError | None]:
        self.most_ahead = max(self.most_ahead, self.ledger.claimed - self.sent - len(jobs))
        return await super().publish_many(jobs, headers)


def _admission(clock: VirtualClock, ledger: ChunkLedger, rate: float) -> DestinationAdmission:
    params = PacingParams(
        tick_seconds=1.0, initial_rate=rate, min_rate=rate, max_rate=rate, max_inflight=10**7
    )
    return DestinationAdmission(
        ledger=ledger, publisher=ConfirmingPublisher(clock, ledger), clock=clock,
        config=AdmissionConfig(destination="d", queue="q", params=params),
    )  # fmt: skip


async def _one_tick(
    clock: VirtualClock, admission: DestinationAdmission, *, cancel_at: float | None = None
) -> TickResult | None:
    result: TickResult | None = None
    with anyio.fail_after(60):  # real seconds
        async with anyio.create_task_group() as tg:
            tg.start_soon(clock.drive, 5.0)
            with anyio.CancelScope() as scope:
                if cancel_at is not None:

                    async def cancel() -> None:
                        await clock.sleep_until(cancel_at)
                        scope.cancel()

                    tg.start_soon(cancel)
                result = await admission.run_once()
            tg.cancel_scope.cancel()
    return result


def _publisher(admission: DestinationAdmission) -> ConfirmingPublisher:
    assert isinstance(admission.publisher, ConfirmingPublisher)
    return admission.publisher


async def test_a_large_budget_is_claimed_in_chunks_while_the_first_ones_publish() -> None:
    clock = VirtualClock()
    ledger = ChunkLedger(clock)
    admission = _admission(clock, ledger, rate=5_000.0)
    result = await _one_tick(clock, admission)
    assert result is not None
    publisher = _publisher(admission)
    assert [limit for limit, _, _ in ledger.claims] == [CLAIM_CHUNK] * 5
    assert (result.claimed, result.offered, result.released) == (5_000, 5_000, 0)
    assert publisher.confirmed == 5_000
    first_chunk_done, last_chunk_done = ledger.claims[0][2], ledger.claims[-1][2]
    assert publisher.sent_at[0] < last_chunk_done  # releases began before the claim ended
    assert publisher.sent_at[0] - first_chunk_done < 0.021  # at the first release point after it
    assert publisher.most_ahead <= 2 * CLAIM_CHUNK  # about one chunk ahead of the releases
    assert publisher.sent_at[-1] < 1.0 + 0.02  # spread over the tick at the rate's spacing


async def test_a_budget_within_one_chunk_is_one_claim() -> None:
    clock = VirtualClock()
    ledger = ChunkLedger(clock)
    result = await _one_tick(clock, _admission(clock, ledger, rate=float(CLAIM_CHUNK)))
    assert result is not None
    assert [(limit, got) for limit, got, _ in ledger.claims] == [(CLAIM_CHUNK, CLAIM_CHUNK)]
    assert (result.offered, result.released) == (CLAIM_CHUNK, 0)


async def test_a_backlog_that_runs_out_mid_claim_is_published_whole() -> None:
    clock = VirtualClock()
    ledger = ChunkLedger(clock, backlog=2_500)
    result = await _one_tick(clock, _admission(clock, ledger, rate=5_000.0))
    assert result is not None
    assert [got for _, got, _ in ledger.claims] == [1_000, 1_000, 500]
    assert (result.claimed, result.offered, result.released) == (2_500, 2_500, 0)


async def test_a_destination_closed_mid_tick_stops_claiming_and_releases_the_rest() -> None:
    clock = VirtualClock()
    ledger = ChunkLedger(clock, closes_at=0.3)
    admission = _admission(clock, ledger, rate=5_000.0)
    result = await _one_tick(clock, admission)
    assert result is not None
    publisher = _publisher(admission)
    assert 0 < result.offered < 0.4 * 5_000
    assert ledger.claimed <= result.offered + 2 * CLAIM_CHUNK  # it did not claim the whole budget
    assert ledger.claimed == result.claimed == result.offered + result.released
    assert len(ledger.released) == result.released == ledger.claimed - publisher.confirmed


async def test_a_tick_cancelled_mid_way_releases_every_claimed_job_it_did_not_publish() -> None:
    clock = VirtualClock()
    ledger = ChunkLedger(clock)
    admission = _admission(clock, ledger, rate=5_000.0)
    assert await _one_tick(clock, admission, cancel_at=0.31) is None  # leadership lost
    publisher = _publisher(admission)
    assert 0 < publisher.confirmed < ledger.claimed
    # every claim that came back is either confirmed or returned (one in flight
    # at the cancel never came back: its jobs return at their claim lease's end)
    assert publisher.confirmed + len(ledger.released) == ledger.claimed


async def test_a_later_chunk_that_fails_ends_the_claim_not_the_tick() -> None:
    clock = VirtualClock()
    ledger = ChunkLedger(clock, fail_on=3)
    result = await _one_tick(clock, _admission(clock, ledger, rate=5_000.0))
    assert result is not None
    assert len(ledger.claims) == 3
    assert (result.claimed, result.offered, result.released) == (2_000, 2_000, 0)


async def test_a_first_chunk_that_fails_fails_the_tick() -> None:
    clock = VirtualClock()
    ledger = ChunkLedger(clock, fail_on=1)
    try:
        await _one_tick(clock, _admission(clock, ledger, rate=5_000.0))
    except* LedgerUnavailable:
        pass
    else:
        raise AssertionError("the tick did not fail")
    assert ledger.claimed == 0
