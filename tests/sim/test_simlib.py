"""The simulation's own parts: the model upstream, the ledger model, the
virtual clock, the baseline law, and runs of the real admission over them."""

from __future__ import annotations

import bisect
import dataclasses
from collections import Counter

import pytest
import trio
import trio.testing
from scenarios import SCENARIOS, Calls, ideal_drain_seconds, utilization
from simclock import SimClock, SimTime
from simdriver import run
from simlib import (
    CLAIMED,
    COMPLETED,
    OFFERED,
    SCHEDULED,
    HalvingLaw,
    Job,
    LedgerSpec,
    Scenario,
    SimLedger,
    Upstream,
    World,
)

from pacerd import pacer
from pacerd.admission import MAX_SLICES_PER_TICK
from pacerd.models import JobRef
from pacerd.pacer import Demand, OutcomeWindow, PacingParams

WINDOW = 60.0


def _claim(
    led: SimLedger, t: float, limit: int, *, live_limit: int = 0, epoch: int = 0
) -> list[Job]:
    return led.claim(t, live_limit=live_limit, limit=limit, epoch=epoch, live_window_seconds=WINDOW)


def _ref(job: Job) -> JobRef:
    return JobRef(job_id=job.job_id, attempt=job.attempt)


def test_the_token_bucket_refuses_above_capacity_and_keeps_its_burst() -> None:
    up = Upstream(Scenario(name="t", duration=10.0, phases=((0.0, 10.0),), burst_seconds=1.0))
    burst = [up.call(0.0)[0] for _ in range(12)]
    assert burst.count(True) == 10  # a full bucket: one second of capacity
    assert up.call(0.05) == (False, None)
    assert up.call(0.1)[0]  # refilled at 10/s


def test_the_bucket_follows_a_capacity_step() -> None:
    sc = Scenario(name="t", duration=10.0, phases=((0.0, 100.0), (1.0, 10.0)), burst_seconds=1.0)
    up = Upstream(sc)
    assert sum(up.call(0.999)[0] for _ in range(200)) == 100
    assert sum(up.call(1.5)[0] for _ in range(50)) == 5  # 0.5 s at the new 10/s
    assert sc.capacity_between(0.5, 1.5) == pytest.approx(55.0)


def test_penalty_mode_closes_the_upstream_and_advertises_the_time_left() -> None:
    sc = Scenario(
        name="t", duration=60.0, phases=((0.0, 1.0),), burst_seconds=1.0, penalty_seconds=10.0
    )
    up = Upstream(sc)
    assert up.call(0.0) == (True, None)
    assert up.call(0.1) == (False, 10.0)  # the overshoot
    accepted, retry_after = up.call(4.1)
    assert not accepted
    assert retry_after == pytest.approx(6.0)
    assert up.call(10.2)[0]


def test_every_refusal_can_say_when_the_next_token_comes_in_whole_seconds() -> None:
    sc = Scenario(name="t", duration=60.0, phases=((0.0, 10.0),), burst_seconds=0.1,
                  retry_after=True)  # fmt: skip
    up = Upstream(sc)
    assert up.call(0.0) == (True, None)  # the bucket's one token
    assert up.call(0.01) == (False, 1.0)  # the next comes in 90 ms: at least a whole second
    slow = Upstream(dataclasses.replace(sc, phases=((0.0, 0.25),), burst_seconds=4.0))
    assert slow.call(0.0) == (True, None)
    assert slow.call(0.5) == (False, 4.0)  # 3.5 s to the next token: rounded up


def test_a_burst_of_refusals_over_the_threshold_closes_the_penalty_box() -> None:
    """As the model upstream counts them: more refusals within the trailing
    second than ``penalty_threshold`` of the capacity (at least one) close it
    for ``penalty_seconds``; fewer do not."""
    sc = Scenario(
        name="t", duration=60.0, phases=((0.0, 20.0),), burst_seconds=0.05,
        penalty_seconds=10.0, penalty_threshold=0.1, retry_after=True,
    )  # fmt: skip
    up = Upstream(sc)
    assert up.call(0.0) == (True, None)
    assert [up.call(0.001 * k)[0] for k in (1, 2)] == [False, False]  # two: at the threshold
    assert not up.call(0.004)[0]  # the third within a second: over 0.1 x 20
    accepted, retry_after = up.call(5.0)
    assert (accepted, retry_after) == (False, 6.0)  # closed until 10.004: whole seconds
    assert up.call(10.1)[0]


def test_a_refused_job_keeps_its_place_in_line_or_waits_for_its_retry_after() -> None:
    led = SimLedger(LedgerSpec(backlog=3))
    first, second, third = _claim(led, 0.0, 3)
    assert led.report(first, 1, 1.0, False, None)
    assert led.report(second, 1, 1.0, False, 30.0)
    assert led.cooldown_until == pytest.approx(31.0)
    assert _claim(led, 2.0, 1) == []  # the destination cools down: nothing is claimed
    assert _claim(led, 30.9, 3) == []
    assert _claim(led, 31.0, 3) == [first, second]  # first kept its place in line
    assert third.attempt == 1
    assert (first.attempt, second.attempt) == (2, 2)
    assert (led.n_refused, led.n_retry_after, led.inflight) == (2, 1, 3)


def test_reports_count_fresh_when_claimed_at_or_after_the_destinations_epoch() -> None:
    led = SimLedger(LedgerSpec())
    (old,) = _claim(led, 0.0, 1, epoch=3)
    led.save_pacer_state({"pacer": {}}, 4)
    (new,) = _claim(led, 0.0, 1, epoch=4)
    led.report(old, 1, 1.0, False, None)
    led.report(new, 1, 1.0, False, None)
    assert (led.n_refused, led.n_refused_fresh) == (2, 1)
    led.save_pacer_state({"pacer": {}}, 2)  # the epoch never goes back
    assert led.epoch == 4


def test_the_claim_reserves_the_live_share_and_is_work_conserving() -> None:
    led = SimLedger(LedgerSpec(backlog=100))
    for i in range(5):
        led.add_live(10.0 + i)
    jobs = _claim(led, 20.0, 10, live_limit=4)
    assert [job.lane_live for job in jobs] == [True] * 4 + [False] * 6
    assert [job.due for job in jobs[:4]] == [10.0, 11.0, 12.0, 13.0]  # oldest first
    quiet = SimLedger(LedgerSpec(backlog=2))
    quiet.add_live(1.0)
    jobs = _claim(quiet, 2.0, 10, live_limit=4)  # each lane takes what the other leaves
    assert [job.lane_live for job in jobs] == [True, False, False]
    busy = SimLedger(LedgerSpec(backlog=0))
    for i in range(8):
        busy.add_live(float(i))
    assert len(_claim(busy, 8.0, 6, live_limit=3)) == 6


def test_live_jobs_become_backlog_after_the_live_window() -> None:
    led = SimLedger(LedgerSpec(backlog=0))
    led.add_live(10.0)
    assert led.due_counts(20.0, WINDOW) == (1, 0)
    assert led.due_counts(70.0, WINDOW) == (0, 1)  # due exactly a window ago: backlog
    (job,) = _claim(led, 71.0, 1, live_limit=1)
    assert not job.lane_live


def test_marks_and_releases_are_fenced_by_state_and_attempt() -> None:
    led = SimLedger(LedgerSpec(backlog=0))
    led.add_live(0.0)
    (job,) = _claim(led, 1.0, 1, live_limit=1)
    assert job.state == CLAIMED
    assert led.mark_offered([JobRef(job_id=job.job_id, attempt=2)]) == []
    assert led.release([_ref(job)]) == [_ref(job)]  # back in its lane, no attempt spent
    assert (job.state, led.inflight, led.due_counts(1.0, WINDOW)) == (SCHEDULED, 0, (1, 0))
    (again,) = _claim(led, 1.0, 1, live_limit=1)
    assert again is job
    assert job.attempt == 2  # never reused
    assert led.mark_offered([_ref(job)]) == [_ref(job)]
    assert (job.state, job.live) == (OFFERED, False)
    assert led.release([_ref(job)]) == []  # offered: not a claim any more
    assert led.report(job, 2, 2.0, True, None)
    assert (job.state, led.inflight, led.n_accepted) == (COMPLETED, 0, 1)
    assert not led.report(job, 2, 2.0, True, None)  # stale
    assert led.n_accepted == 1


def test_sleepers_wake_in_deadline_order_when_the_driver_moves_the_time() -> None:
    woke: list[tuple[str, float]] = []

    async def main() -> None:
        time = SimTime()
        a, b = SimClock(time, offset=1000.0), SimClock(time, offset=5.0)

        async def sleeper(name: str, clock: SimClock, deadline: float) -> None:
            await clock.sleep_until(deadline)
            woke.append((name, clock.monotonic()))

        scope = trio.CancelScope()

        async def cancelled() -> None:
            with scope:
                await sleeper("c", a, 1001.0)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(sleeper, "a", a, 1003.0)
            nursery.start_soon(sleeper, "b", b, 6.0)
            nursery.start_soon(cancelled)
            await trio.testing.wait_all_tasks_blocked()
            scope.cancel()
            await trio.testing.wait_all_tasks_blocked()
            assert time.next_wake() == 1.0
            time.wake(1.0)
            await trio.testing.wait_all_tasks_blocked()
            assert woke == [("b", 6.0)]
            time.wake(time.next_wake())
        assert time.t == 3.0

    trio.run(main)
    assert woke == [("b", 6.0), ("a", 1003.0)]


def test_the_halving_law_halves_on_refusal_and_adds_one_on_a_busy_clean_tick() -> None:
    p = PacingParams(initial_rate=40.0)
    law = HalvingLaw()
    state = pacer.initial_state(p, now=0.0)
    busy = Demand(budget=40, admitted=40)
    state, plan = law(state, OutcomeWindow(refused=1), busy, now=0.0, inflight=0, params=p)
    assert (state.rate, plan.budget) == (20.0, 20)
    state, _ = law(state, OutcomeWindow(accepted=20), busy, now=1.0, inflight=0, params=p)
    assert state.rate == 21.0
    idle = Demand(budget=21, admitted=3, backlog_empty=True)
    state, _ = law(state, OutcomeWindow(accepted=3), idle, now=2.0, inflight=0, params=p)
    assert state.rate == 21.0


def test_a_run_is_deterministic_for_a_seed() -> None:
    sc = SCENARIOS["S5"]
    a, b = run(sc, "pacerd", 3), run(sc, "pacerd", 3)
    assert (a.call_t, a.call_ok) == (b.call_t, b.call_ok)
    c = run(sc, "pacerd", 4)
    assert a.call_t != c.call_t


def test_two_instances_on_one_upstream_are_deterministic_too() -> None:
    sc = dataclasses.replace(SCENARIOS["S2"], duration=130.0)
    a, b = run(sc, "pacerd", 1), run(sc, "pacerd", 1)
    assert (a.call_t, a.call_inst, a.call_ok) == (b.call_t, b.call_inst, b.call_ok)
    assert set(a.call_inst) == {0, 1}


def test_admission_publishes_its_claims_in_release_slices() -> None:
    res = run(SCENARIOS["S5"], "pacerd", 0)
    jobs_at = Counter(res.dispatch_t)
    releases = sorted(jobs_at)
    assert max(jobs_at.values()) > 1  # a release slice carries several jobs
    busy = [r for r in res.ticks if r.claimed > MAX_SLICES_PER_TICK]
    assert busy
    for r in busy:  # at most MAX_SLICES_PER_TICK releases a tick (one may fall on its end)
        n = bisect.bisect_left(releases, r.t + r.span) - bisect.bisect_left(releases, r.t)
        assert n <= MAX_SLICES_PER_TICK + 1
    assert all(r.claimed <= r.budget for r in res.ticks)


def test_utilization_counts_accepted_calls_against_the_capacity_integral() -> None:
    res = run(SCENARIOS["S5"], "halving", 0)
    ok, _ = Calls(res).counts(0.0, 120.0)
    assert utilization(res, 0.0, 120.0) == pytest.approx(ok / (100.0 * 120.0))


def test_the_ideal_drain_time_nets_out_the_live_load() -> None:
    # 28,500 jobs in the first 300 s (100 - 5/s), 7,500 in the next 300 s
    # (30 - 5/s), the last 4,000 at 75/s
    assert ideal_drain_seconds(SCENARIOS["S4"]) == pytest.approx(600.0 + 4000.0 / 75.0)


def test_a_paused_ledger_is_released_from_when_its_resume_wakes_the_instance() -> None:
    # ticks at 0, 1, 2 find it paused; the resume at 2.5 reopens it at once
    base = SCENARIOS["S5"]
    sc = dataclasses.replace(
        base, duration=6.0, ledgers=(LedgerSpec(backlog=None, paused_until=2.5),),
        params=dataclasses.replace(base.params, initial_rate=20.0),
    )  # fmt: skip
    res = run(sc, "pacerd", 0)
    assert res.dispatch_t
    assert min(res.dispatch_t) >= 2.5
    assert min(res.dispatch_t) < 2.6  # not at the next tick (3.0)
    reopening = next(r for r in res.ticks if r.budget > 0)
    assert reopening.t == pytest.approx(2.5)
    assert reopening.span == pytest.approx(0.5)  # the rest of its tick


@pytest.mark.parametrize("refusal_latency", [True, False])
def test_a_refusal_reaches_the_ledger_after_the_latency_or_at_once(refusal_latency: bool) -> None:
    sc = dataclasses.replace(
        SCENARIOS["S5"], duration=20.0, retry_after=True, refusal_latency=refusal_latency,
        latency_median=0.5, latency_sigma=0.01, report_delay_median=0.001,
        report_delay_sigma=0.01,
    )  # fmt: skip
    res = run(sc, "pacerd", 0)
    assert res.ra_windows
    for visible, ends in res.ra_windows:  # a Retry-After of 1 s at 100/s: called = ends - 1
        delay = visible - (ends - 1.0)
        assert (delay > 0.4) is refusal_latency


def slow_calls(name: str, latency_median: float, duration: float) -> Scenario:
    """An upstream of 100/s whose calls take ``latency_median`` seconds (1 s
    ticks), an overdue backlog that never runs dry, slow start from 10/s."""
    return Scenario(
        name=name,
        duration=duration,
        phases=((0.0, 100.0),),
        burst_seconds=0.1,
        params=PacingParams(initial_rate=10.0),
        ledgers=(LedgerSpec(backlog=20_000),),
        workers=2_000,
        latency_median=latency_median,
        latency_sigma=0.3,
    )


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_calls_slower_than_a_tick_are_still_paced_up_to_the_capacity(seed: int) -> None:
    # each call takes ~3 ticks: three ticks of the rate in flight, over the
    # in-flight bound of growth when the round trip counted as a tick (slow
    # start stayed at initial_rate, 10 % of this capacity, for good)
    res = run(slow_calls("slow-calls", 3.0, 60.0), "pacerd", seed)
    assert utilization(res, 30.0, 60.0) >= 0.9


@pytest.mark.parametrize("seed", [0, 5])
def test_calls_slower_than_their_first_outcome_do_not_stall_slow_start(seed: int) -> None:
    # calls of ~20 s; with seed 5 the first outcome came back after 9 s, so
    # twice that round trip of the rate was less than what was in flight, and
    # slow start stayed at initial_rate while every call was accepted
    res = run(slow_calls("slow", 20.0, 150.0), "pacerd", seed)
    assert utilization(res, 60.0, 150.0) >= 0.5


@pytest.mark.parametrize(("latency", "seed"), [(1.5, 4), (3.0, 1), (3.0, 2)])
def test_slow_calls_refused_at_once_are_cut_by_the_share_of_what_was_sent(
    latency: float, seed: int
) -> None:
    # an upstream that answers 429 at once and its calls after seconds: the
    # outcomes heard were mostly refusals of what had just been sent, and a
    # cut by their share fell to a fraction of the capacity (0.46-0.80 here)
    sc = dataclasses.replace(slow_calls("slow-calls", latency, 60.0), refusal_latency=False)
    res = run(sc, "pacerd", seed)
    assert utilization(res, 30.0, 60.0) >= 0.9


def slow_workers(name: str, tick: float) -> Scenario:
    """An upstream of 300/s and 20 workers whose calls take ~0.15 s: they call
    about 130 a second, and nothing is refused; slow start from 10/s."""
    return Scenario(
        name=name,
        duration=10.0,
        phases=((0.0, 300.0),),
        burst_seconds=0.1,
        params=PacingParams(tick_seconds=tick, initial_rate=10.0),
        ledgers=(LedgerSpec(backlog=20_000),),
        workers=20,
        latency_median=0.15,
        latency_sigma=0.3,
    )


@pytest.mark.parametrize(("tick", "seed"), [(0.5, 0), (0.5, 1), (1.0, 0), (1.0, 1)])
def test_slow_start_ends_at_the_pace_of_workers_slower_than_the_upstream(
    tick: float, seed: int
) -> None:
    # slow start ran on to ~400/s, three times what the workers call: the
    # work it released piled up before them, to be called whatever the
    # upstream's capacity by then
    res = run(slow_workers("slow-workers", tick), "pacerd", seed)
    pace = sum(1 for t in res.call_t if 5.0 <= t < 10.0) / 5.0
    assert max(t.rate for t in res.ticks if 5.0 <= t.t < 10.0) <= 1.2 * pace


@pytest.mark.parametrize(("tick", "seed"), [(0.5, 0), (0.5, 3), (1.0, 1)])
def test_past_slow_start_the_rate_stays_within_reach_of_workers_slower_than_it(
    tick: float, seed: int
) -> None:
    # a ladder over the firm ceiling slow start left went on to ~3 times what
    # the workers call (nothing refuses while they hold the calls back);
    # growth now stops while the outcomes come back at under half the rate
    sc = dataclasses.replace(slow_workers("slow-workers-long", tick), duration=60.0)
    res = run(sc, "pacerd", seed)
    pace = sum(1 for t in res.call_t if 15.0 <= t < 60.0) / 45.0
    highest = max(t.rate for t in res.ticks if 15.0 <= t.t < 60.0)
    assert highest <= 1.25 * pacer.RETURN_SHARE**-1 * pace  # the hold and one ladder step


def test_the_delivery_path_stalls_and_catches_up_in_a_bunch() -> None:
    """With ``stall_every_s``, no call reaches the upstream during a stall,
    and the calls it held arrive together at its end; the stalls are drawn
    from a generator of their own, so drawing them changes nothing else."""
    sc = dataclasses.replace(SCENARIOS["S5"], duration=60.0, stall_every_s=5.0, stall_seconds=0.15)
    res = run(sc, "pacerd", 3)
    stalls = World(sc, "pacerd", 3).stalls
    assert len(stalls) >= 4
    assert all(b - a == pytest.approx(0.15) for a, b in stalls)
    assert not [t for t in res.call_t if any(a < t < b for a, b in stalls)]
    at_ends = Counter(t for t in res.call_t if any(t == b for _, b in stalls))
    assert max(at_ends.values()) >= 10  # the ~15 calls of 0.15 s at 100/s, at once
    plain = dataclasses.replace(sc, stall_every_s=None)
    assert World(plain, "pacerd", 3).stalls == []
    never = dataclasses.replace(sc, stall_every_s=1e9)  # drawn, but none within the run
    assert World(never, "pacerd", 3).stalls == []
    assert run(never, "pacerd", 3).call_t == run(plain, "pacerd", 3).call_t
