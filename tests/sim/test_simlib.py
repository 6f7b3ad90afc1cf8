"""The simulation's own parts: the model upstream, the ledger model, determinism."""

from __future__ import annotations

import pytest
from scenarios import SCENARIOS, Calls, ideal_drain_seconds, utilization
from simlib import Job, LedgerSpec, Scenario, SimLedger, Upstream, run

from pacerd.pacer import PacingParams


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


def test_a_refused_job_keeps_its_place_in_line_or_waits_for_its_retry_after() -> None:
    led = SimLedger(LedgerSpec(backlog=3), PacingParams())
    first, second, third = led.claim(0, 3, epoch=0)
    led.report(first, 1.0, False, None)
    led.report(second, 1.0, False, 30.0)
    assert led.due_counts(2.0) == (0, 1)
    assert led.claim(0, 1, epoch=0) == [first]
    assert led.cooldown_until == pytest.approx(31.0)
    assert led.due_counts(31.0) == (0, 1)
    assert led.claim(0, 1, epoch=0) == [second]
    assert third.attempt == 1
    assert first.attempt == 2


def test_fresh_means_claimed_at_or_after_the_current_epoch() -> None:
    led = SimLedger(LedgerSpec(), PacingParams())
    old = led.claim(0, 1, epoch=3)[0]
    led.epoch = 4
    new = led.claim(0, 1, epoch=4)[0]
    led.report(old, 1.0, False, None)
    led.report(new, 1.0, False, None)
    window = led.take_window(1.0)
    assert (window.refused, window.refused_fresh) == (2, 1)


def test_live_jobs_become_backlog_after_the_live_window() -> None:
    led = SimLedger(LedgerSpec(backlog=0), PacingParams(live_window_seconds=60.0))
    led.add_live(10.0)
    assert led.due_counts(20.0) == (1, 0)
    assert led.due_counts(71.0) == (0, 1)
    assert isinstance(led.claim(0, 1, epoch=0)[0], Job)


def test_a_run_is_deterministic_for_a_seed() -> None:
    sc = SCENARIOS["S5"]
    a, b = run(sc, "pacerd", 3), run(sc, "pacerd", 3)
    assert (a.call_t, a.call_ok) == (b.call_t, b.call_ok)
    c = run(sc, "pacerd", 4)
    assert a.call_t != c.call_t


def test_utilization_counts_accepted_calls_against_the_capacity_integral() -> None:
    res = run(SCENARIOS["S5"], "halving", 0)
    ok, _ = Calls(res).counts(0.0, 120.0)
    assert utilization(res, 0.0, 120.0) == pytest.approx(ok / (100.0 * 120.0))


def test_the_ideal_drain_time_nets_out_the_live_load() -> None:
    # 28,500 jobs in the first 300 s (100 - 5/s), 7,500 in the next 300 s
    # (30 - 5/s), the last 4,000 at 75/s
    assert ideal_drain_seconds(SCENARIOS["S4"]) == pytest.approx(600.0 + 4000.0 / 75.0)
