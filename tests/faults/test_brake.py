"""A tick that meets an upstream far slower than its rate, in virtual time:
it hears the refusals while it releases (``pacer.brake``), cuts the rate
within the tick, gives the claims it has not sent back and releases the rest
of the tick at the new rate; every job it claimed is published or released.
The same tick without the brake (a budget under ``BRAKE_MIN_BUDGET`` is not
watched) is the control."""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING

import anyio
from support.fakes import FakeLedger, FakePublisher, VirtualClock

from pacerd import pacer
from pacerd.admission import AdmissionConfig, DestinationAdmission, TickResult
from pacerd.pacer import PacingParams

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    import pytest

    from pacerd.models import ClaimedJob, DestinationRow

CALL_SECONDS = 0.03  # from a publish to its outcome in the ledger


class Bucket:
    """A token bucket upstream (``capacity`` a second, a burst of a tenth of
    that) whose outcomes reach ``ledger`` ``CALL_SECONDS`` after the publish."""

    def __init__(self, clock: VirtualClock, ledger: FakeLedger, capacity: float) -> None:
        self.clock, self.ledger, self.capacity = clock, ledger, capacity
        self.tokens, self.at = capacity / 10, 0.0
        self.due: list[tuple[float, int, ClaimedJob]] = []
        self.calls: list[tuple[float, bool]] = []

    def published(self, jobs: Sequence[ClaimedJob]) -> None:
        for job in jobs:
            heapq.heappush(self.due, (self.clock.monotonic() + CALL_SECONDS, len(self.calls), job))
            self.calls.append((self.clock.monotonic(), False))  # its slot; set on the call

    async def run(self) -> None:
        while True:
            while self.due and self.due[0][0] <= self.clock.monotonic():
                at, slot, job = heapq.heappop(self.due)
                self.tokens = min(self.capacity / 10, self.tokens + (at - self.at) * self.capacity)
                self.at = at
                ok = self.tokens >= 1.0
                self.tokens -= ok
                self.calls[slot] = (at, ok)
                self.ledger.report(job.ref, accepted=ok)
            await self.clock.sleep(0.005)


class ReadCounting(FakeLedger):
    """Counts the destination reads (not the release slices' closed checks)."""

    reads = 0

    async def read_destination(
        self, destination: str, *, inflight: bool = False
    ) -> DestinationRow | None:
        self.reads += 1
        return await super().read_destination(destination, inflight=inflight)

    async def is_closed(self, destination: str) -> bool:
        row = await FakeLedger.read_destination(self, destination)
        return row is not None and row.closed


async def _tick(
    rate: float,
    capacity: float,
    *,
    pacer_state: Mapping[str, object] | None = None,
    inflight: int = 0,
    ticks: int = 1,
) -> tuple[TickResult, ReadCounting, Bucket, float]:
    """Runs ``ticks`` ticks on the schedule; the last one's result."""
    clock = VirtualClock()
    ledger = ReadCounting(clock)
    ledger.add_destination("d", overdue=None)
    if inflight:  # claimed before the tick, never reported
        claimed = await ledger.claim_due(
            "d", live_limit=0, limit=inflight, claim_seconds=60.0, epoch=0,
            live_window_seconds=60.0, instance="other",
        )  # fmt: skip
        assert len(claimed) == inflight
    if pacer_state is not None:
        await ledger.save_pacer_state("d", {"pacer": pacer_state}, epoch=0)
    bucket = Bucket(clock, ledger, capacity)
    params = PacingParams(tick_seconds=1.0, initial_rate=rate, max_rate=10_000.0)
    admission = DestinationAdmission(
        ledger=ledger, clock=clock,
        publisher=FakePublisher(clock, confirm_seconds=0.002, on_confirmed=bucket.published),
        config=AdmissionConfig(destination="d", queue="q", params=params),
    )  # fmt: skip
    with anyio.fail_after(60):  # real seconds
        async with anyio.create_task_group() as tg:
            tg.start_soon(clock.drive, 5.0)
            tg.start_soon(bucket.run)
            for _ in range(ticks - 1):
                await admission.run_once()
                assert admission.next_deadline is not None
                await clock.sleep_until(admission.next_deadline)
            result = await admission.run_once()
            await clock.sleep(0.2)  # the last outcomes come in
            tg.cancel_scope.cancel()
    assert admission.state is not None
    return result, ledger, bucket, admission.state.rate


async def test_a_tick_far_over_the_capacity_is_braked_within_the_tick() -> None:
    result, ledger, bucket, rate = await _tick(rate=200.0, capacity=100.0)
    refused = sum(not ok for _, ok in bucket.calls)
    # cut once the refusals were heard, not a tick later, to about the capacity
    assert 90.0 <= rate <= 125.0, rate
    assert refused <= 30, refused  # without the brake: about 90 (the control below)
    assert sum(ok for _, ok in bucket.calls) >= 85  # and the upstream was kept busy
    # every claim is accounted for: published, or given back
    assert result.claimed == ledger.claimed == result.offered + result.released
    assert result.released == len(ledger.released) > 0
    assert result.offered == len(bucket.calls)


async def test_without_the_brake_the_tick_refuses_its_whole_excess(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # the control: the same tick, not watched (its budget is under the floor)
    monkeypatch.setattr(pacer, "BRAKE_MIN_BUDGET", 10**9)
    result, _, bucket, rate = await _tick(rate=200.0, capacity=100.0)
    assert rate == 200.0  # the tick's own step comes only at the next tick
    assert sum(not ok for _, ok in bucket.calls) >= 70
    assert result.released == 0


async def test_a_ramping_tick_braked_measures_the_rate_it_releases_at_after_the_cut(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # a first tick at 60/s, all accepted; the next grows and ramps from 180/s
    # toward 540/s into a capacity of 100/s. Braked, it releases the rest of
    # the tick evenly at the cut's rate: the brakes after that one measure
    # that rate, not the ramp's (which would raise the rate cut a moment
    # before). The first cut is made to land over the capacity (as a noisy
    # estimate from a few outcomes may), so that the tick is braked again.
    calls: list[tuple[float, float, float | None]] = []  # (rate, sent, the cut's rate)
    brake = pacer.brake

    def recorded(
        state: pacer.PacerState, window: pacer.OutcomeWindow, params: PacingParams, **kw: float
    ) -> pacer.PacerState | None:
        cut = brake(state, window, params, **kw)
        if cut is not None and not calls:
            cut = cut._replace(rate=1.6 * cut.rate)
        calls.append((state.rate, kw["sent"], None if cut is None else cut.rate))
        return cut

    monkeypatch.setattr(pacer, "brake", recorded)
    result, ledger, _, rate = await _tick(rate=60.0, capacity=100.0, ticks=2)
    first = next(i for i, (_, _, cut) in enumerate(calls) if cut is not None)
    later = calls[first + 1 :]
    assert later, calls  # heard again after the first cut
    assert all(sent == before for before, sent, _ in later), calls
    assert all(cut < before for before, _, cut in later if cut is not None), calls
    assert rate <= 125.0, calls
    assert result.claimed == ledger.claimed - 60 == result.offered + result.released


async def test_past_slow_start_a_tick_far_over_a_capacity_that_fell_is_braked() -> None:
    # held at a measured ceiling of 200/s when the capacity falls to 100/s
    state = {"rate": 200.0, "ceiling": 200.0, "epoch": 0}
    result, ledger, bucket, rate = await _tick(rate=200.0, capacity=100.0, pacer_state=state)
    assert 80.0 <= rate <= 125.0, rate
    assert sum(not ok for _, ok in bucket.calls) <= 35  # the control: about 90
    assert result.claimed == ledger.claimed == result.offered + result.released


async def test_past_slow_start_a_long_round_trip_is_not_watched() -> None:
    # a rate held at its measured ceiling, its round trip short: watched
    state = {"rate": 90.0, "ceiling": 90.0, "epoch": 0}
    _, ledger, _, _ = await _tick(rate=90.0, capacity=100.0, pacer_state=state)
    assert ledger.reads > 1
    # the same with a second's worth of jobs still in flight at the tick's
    # start (a round trip of a second): the tick's own step decides, and
    # the tick sends no mid-tick read (one read: the tick's own, at its start)
    _, ledger, _, _ = await _tick(rate=90.0, capacity=100.0, pacer_state=state, inflight=90)
    assert ledger.reads == 1


async def test_a_ladders_probe_over_the_capacity_is_braked_to_just_under_its_rung() -> None:
    # the ladder stepped from 98.6/s (a clean rung) to 123.3/s over a
    # capacity of 100/s: a fifth of the calls refused once the burst is spent
    probe = {"rate": 123.3, "ceiling": 80.0, "ladder": 24.7, "epoch": 0}
    _, _, braked, rate = await _tick(rate=123.3, capacity=100.0, pacer_state=probe)
    assert 98.6 * (1 - PacingParams().decrease_margin) - 1e-9 <= rate < 123.3, rate
    # the control: the same rate, stepped up by no ladder, is left to the
    # next tick (a few refusals past slow start are not a drop)
    held = {**probe, "ladder": 0.0}
    _, _, control, same = await _tick(rate=123.3, capacity=100.0, pacer_state=held)
    assert same == 123.3
    refused = sum(not ok for _, ok in braked.calls)
    assert refused < sum(not ok for _, ok in control.calls) / 2, refused
