"""What admission relies on from its ledger (``admission.AdmissionLedger``):
one body of cases, run against every implementation (the model is River's
driver test suite). A test module subclasses ``LedgerContract`` and gives a
``driver`` fixture: the ledger under test, on one destination ``DEST``, and
the two things a producer and a worker do to it (schedule, report)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from pacerd.models import JobRef

if TYPE_CHECKING:
    from pacerd.admission import AdmissionLedger
    from pacerd.models import ClaimedJob

DEST = "d"
WINDOW = 60.0  # the live window of every claim here
BACKLOG_AGO = 600.0  # a backlog job falls due this long ago (beyond the live window)


class LedgerDriver(Protocol):
    @property
    def ledger(self) -> AdmissionLedger: ...

    async def schedule(self, job_id: str, *, ago: float) -> None:
        """A new job of ``DEST``, due ``ago`` seconds ago (negative: not yet due)."""
        ...

    async def report(
        self, ref: JobRef, *, accepted: bool, retry_after_s: float | None = None
    ) -> None:
        """A worker's ``ok`` or ``refused`` on the attempt ``ref``."""
        ...


async def inflight(ledger: AdmissionLedger) -> int:
    """The destination's claimed and offered jobs, as a tick reads them."""
    row = await ledger.read_destination(DEST, inflight=True)
    assert row is not None
    assert row.inflight is not None
    return row.inflight


async def claim(
    driver: LedgerDriver, limit: int, *, live_limit: int = 0, epoch: int = 0
) -> list[ClaimedJob]:
    return await driver.ledger.claim_due(
        DEST, live_limit=live_limit, limit=limit, claim_seconds=30.0, epoch=epoch,
        live_window_seconds=WINDOW, instance="contract",
    )  # fmt: skip


def lanes(jobs: list[ClaimedJob]) -> tuple[list[str], list[str]]:
    """The ids claimed through the live lane and the backlog lane, in order."""
    return [j.job_id for j in jobs if j.live], [j.job_id for j in jobs if not j.live]


def stale(ref: JobRef) -> JobRef:
    return JobRef(job_id=ref.job_id, attempt=ref.attempt + 1)


async def backlog(driver: LedgerDriver, *ids: str) -> None:
    """Backlog jobs, ``ids[0]`` the oldest, each 10 s after the one before."""
    for i, job_id in enumerate(ids):
        await driver.schedule(job_id, ago=BACKLOG_AGO - 10 * i)


class LedgerContract:
    async def test_a_claim_takes_at_most_limit_oldest_first_and_never_a_job_twice(
        self, driver: LedgerDriver
    ) -> None:
        await backlog(driver, "b1", "b2", "b3", "b4", "b5")
        first = await claim(driver, 3)
        assert lanes(first) == ([], ["b1", "b2", "b3"])
        assert all(job.attempt == 1 and job.destination == DEST for job in first)
        due = [job.eligible_at for job in first]  # each job's next_attempt_at
        assert due == sorted(due)
        assert len(set(due)) == 3
        assert lanes(await claim(driver, 3)) == ([], ["b4", "b5"])
        assert await claim(driver, 3) == []

    async def test_the_live_lane_keeps_live_limit_and_each_lane_fills_what_the_other_cannot(
        self, driver: LedgerDriver
    ) -> None:
        await backlog(driver, "b1", "b2", "b3")
        for job_id, ago in (("l1", 30.0), ("l2", 20.0), ("l3", 10.0)):
            await driver.schedule(job_id, ago=ago)  # never offered, due within the window
        assert lanes(await claim(driver, 3, live_limit=1)) == (["l1"], ["b1", "b2"])
        # one backlog job left: the live lane takes the rest of the limit
        assert lanes(await claim(driver, 4, live_limit=0)) == (["l2", "l3"], ["b3"])

    async def test_a_job_not_yet_due_is_neither_claimed_nor_counted(
        self, driver: LedgerDriver
    ) -> None:
        await driver.schedule("later", ago=-60.0)
        await backlog(driver, "b1", "b2", "b3")
        assert await driver.ledger.has_due(DEST, at_least=2) == 2
        assert await driver.ledger.has_due(DEST, at_least=10) == 3
        assert lanes(await claim(driver, 10)) == ([], ["b1", "b2", "b3"])
        assert await driver.ledger.has_due(DEST, at_least=10) == 0

    async def test_claimed_and_offered_jobs_are_in_flight_until_released_or_reported(
        self, driver: LedgerDriver
    ) -> None:
        ledger = driver.ledger
        await backlog(driver, "b1", "b2", "b3")
        assert await inflight(ledger) == 0
        a, b, _ = (job.ref for job in await claim(driver, 3))
        assert await inflight(ledger) == 3
        await ledger.mark_offered([a], offer_seconds=300.0)
        assert await inflight(ledger) == 3
        await ledger.release_claims([b], reason="contract")
        assert await inflight(ledger) == 2
        await driver.report(a, accepted=True)
        assert await inflight(ledger) == 1

    async def test_offer_and_release_return_what_they_changed_and_ignore_stale_attempts(
        self, driver: LedgerDriver
    ) -> None:
        ledger = driver.ledger
        await backlog(driver, "b1", "b2")
        a, b = (job.ref for job in await claim(driver, 2))
        assert await ledger.mark_offered([a, stale(b)], offer_seconds=300.0) == [a]
        assert await ledger.mark_offered([a], offer_seconds=300.0) == []  # offered already
        assert await ledger.release_claims([a, stale(b)], reason="contract") == []
        assert await ledger.release_claims([b], reason="contract") == [b]
        assert await ledger.release_claims([b], reason="contract") == []
        (again,) = await claim(driver, 2)
        assert again.ref == stale(b)  # claimed anew: the next attempt
        assert await ledger.mark_offered([b], offer_seconds=300.0) == []
        assert await ledger.release_claims([b], reason="contract") == []

    async def test_a_released_job_comes_back_in_its_place_and_its_lane(
        self, driver: LedgerDriver
    ) -> None:
        await backlog(driver, "b1")
        await driver.schedule("l1", ago=10.0)
        claimed = await claim(driver, 2, live_limit=1)
        assert lanes(claimed) == (["l1"], ["b1"])
        await driver.ledger.release_claims([job.ref for job in claimed], reason="contract")
        again = await claim(driver, 2, live_limit=1)
        assert lanes(again) == (["l1"], ["b1"])
        assert [job.attempt for job in again] == [2, 2]

    async def test_a_job_once_offered_comes_back_in_the_backlog_lane(
        self, driver: LedgerDriver
    ) -> None:
        await driver.schedule("l1", ago=10.0)
        (job,) = await claim(driver, 1, live_limit=1)
        assert job.live
        await driver.ledger.mark_offered([job.ref], offer_seconds=300.0)
        await driver.report(job.ref, accepted=False)
        assert lanes(await claim(driver, 1, live_limit=1)) == ([], ["l1"])

    async def test_the_pacer_state_round_trips_and_the_epoch_only_grows(
        self, driver: LedgerDriver
    ) -> None:
        ledger = driver.ledger
        state = {"pacer": {"rate": 12.5, "epoch": 2}, "tick": {"by": "x", "skipped": None}}
        await ledger.save_pacer_state(DEST, state, epoch=2)
        row = await ledger.read_destination(DEST)
        assert row is not None
        assert (row.pacer_state, row.epoch) == (state, 2)
        later = {"pacer": {"rate": 3.0}}
        await ledger.save_pacer_state(DEST, later, epoch=1)
        row = await ledger.read_destination(DEST)
        assert row is not None
        assert (row.pacer_state, row.epoch) == (later, 2)

    async def test_an_unknown_destination_reads_as_none(self, driver: LedgerDriver) -> None:
        assert await driver.ledger.read_destination("nowhere") is None

    async def test_reports_count_fresh_only_for_claims_at_the_current_epoch(
        self, driver: LedgerDriver
    ) -> None:
        ledger = driver.ledger
        await backlog(driver, "b1", "b2")
        a, b = (job.ref for job in await claim(driver, 2, epoch=0))
        await ledger.mark_offered([a, b], offer_seconds=300.0)
        await driver.report(a, accepted=True)
        await ledger.save_pacer_state(DEST, {}, epoch=1)  # a cut: b was claimed before it
        await driver.report(b, accepted=False)
        row = await ledger.read_destination(DEST)
        assert row is not None
        assert (row.n_accepted, row.n_accepted_fresh) == (1, 1)
        assert (row.n_refused, row.n_refused_fresh, row.n_retry_after) == (1, 0, 0)
        assert row.cooldown_remaining_seconds == 0.0

    async def test_a_retry_after_closes_the_destination_to_claims(
        self, driver: LedgerDriver
    ) -> None:
        ledger = driver.ledger
        await backlog(driver, "b1", "b2")
        (a,) = (job.ref for job in await claim(driver, 1))
        await ledger.mark_offered([a], offer_seconds=300.0)
        await driver.report(a, accepted=False, retry_after_s=30.0)
        row = await ledger.read_destination(DEST)
        assert row is not None
        assert row.n_retry_after == 1
        assert 25.0 < row.cooldown_remaining_seconds <= 30.0
        assert await ledger.has_due(DEST, at_least=5) == 1  # b2; b1 waits out the Retry-After
        assert await claim(driver, 5) == []
