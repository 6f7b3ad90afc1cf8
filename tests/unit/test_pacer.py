"""The pacing law and the tick arithmetic (pure: no clock, no I/O)."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import subprocess
import sys
from typing import Any, TypeVar, cast

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from pacerd import pacer
from pacerd.pacer import (
    CATCH_UP,
    Demand,
    OutcomeWindow,
    PacerState,
    PacingParams,
    TickPlan,
    initial_state,
    next_deadline,
    plan_tick,
    publish_offsets,
    split_lanes,
)

P = PacingParams()
T0 = 1000.0
EMPTY = OutcomeWindow()
_V = TypeVar("_V")


def replace(value: _V, **changes: Any) -> _V:
    """A copy of ``value`` with ``changes``: ``_replace`` of a ``PacerState``
    (a named tuple), ``dataclasses.replace`` of the parameters and windows."""
    if isinstance(value, PacerState):
        return cast("_V", value._replace(**changes))
    return cast("_V", dataclasses.replace(cast("Any", value), **changes))


def full(budget: int) -> Demand:
    """A previous tick that used its whole budget."""
    return Demand(budget=budget, admitted=budget)


def run(
    state: PacerState,
    window: OutcomeWindow = EMPTY,
    demand: Demand | None = None,
    *,
    dt: float = 1.0,
    inflight: int = 0,
    params: PacingParams = P,
    cooldown: float = 0.0,
    paused: bool = False,
) -> tuple[PacerState, TickPlan]:
    return plan_tick(
        state,
        window,
        demand,
        now=state.last_tick + dt,
        inflight=inflight,
        params=params,
        cooldown_remaining_s=cooldown,
        paused=paused,
    )


def at_ceiling(rate: float = 100.0, ceiling: float = 100.0) -> PacerState:
    """A destination in congestion avoidance, its ceiling measured precisely."""
    return replace(
        initial_state(P, now=T0), rate=rate, ceiling=ceiling, firm=True, saved=1e9, epoch=7
    )


# --- tick arithmetic ------------------------------------------------------------


def test_first_tick_admits_one_tick_of_the_initial_rate() -> None:
    state, plan = plan_tick(initial_state(P, now=T0), EMPTY, None, now=T0, inflight=0, params=P)
    assert plan.budget == 10
    assert plan.next_deadline == T0 + 1.0
    assert plan.spacing_seconds == pytest.approx(0.1)
    assert state.last_tick == T0


def test_fractional_budget_is_carried_as_credit() -> None:
    state = replace(initial_state(P, now=T0), rate=2.5, ceiling=1e6, saved=1e9)
    budgets = []
    for _ in range(4):
        state, plan = run(state, demand=Demand(budget=0), paused=False)
        budgets.append(plan.budget)
        assert 0.0 <= state.credit < 1.0
    assert budgets == [2, 3, 2, 3]


def test_budget_is_capped_by_the_inflight_room_and_never_negative() -> None:
    state = at_ceiling()
    _, plan = run(state, inflight=P.max_inflight - 3)
    assert (plan.budget, plan.inflight_capped) == (3, True)
    _, plan = run(state, inflight=P.max_inflight + 50)
    assert plan.budget == 0


def test_missed_ticks_are_skipped_not_replayed() -> None:
    state = at_ceiling(rate=100.0)
    state, plan = run(state, dt=10.0)
    assert plan.budget <= 2 * 100
    assert plan.next_deadline > state.last_tick


def test_a_late_tick_never_releases_faster_than_catch_up_times_the_rate() -> None:
    state = at_ceiling(rate=100.0)
    state, _ = run(state, dt=1.0)  # on schedule: the next deadline is one tick away
    for late in (0.05, 0.3, 0.6, 0.95):
        _, plan = run(state, dt=1.0 + late)  # started `late` after its deadline
        span = plan.next_deadline - (state.last_tick + 1.0 + late)
        assert plan.budget <= CATCH_UP * 100.0 * span + 1, (late, plan.budget, span)
        assert plan.budget * plan.spacing_seconds <= span + 1e-9
    _, plan = run(state, dt=1.02)  # slightly late: the whole elapsed time is caught up
    assert 101 <= plan.budget <= 102  # (a fraction may stay as credit)


DRILL = replace(P, tick_seconds=0.2, min_rate=6.0, max_rate=6.0)  # 1.2 jobs a tick


def test_a_tick_ending_late_near_the_next_point_is_followed_by_one_with_a_job() -> None:
    """A tick started 0.43 s late (a stalled machine) and ended 0.16 s past
    its deadline: the next tick, run at once, spans at least half a tick (to
    the point after), so it pays for the time since the late one (capped at
    CATCH_UP x the rate over that span) and sends a job; it does not pay 40 ms,
    send nothing, and leave the next one 40 ms to pay for, sending nothing too."""
    state = replace(initial_state(DRILL, now=T0), rate=6.0, ceiling=6.0, firm=True, deadline=T0)
    state, late = pacer.tick_budget(state, now=T0 + 0.43, inflight=0, params=DRILL)
    assert late.budget == 1
    assert late.next_deadline == pytest.approx(T0 + 0.6)
    state, follower = pacer.tick_budget(state, now=T0 + 0.76, inflight=0, params=DRILL)
    assert follower.next_deadline == pytest.approx(T0 + 1.0)  # not T0 + 0.8, 40 ms on
    assert follower.budget >= 1


@settings(max_examples=300, deadline=None)
@given(
    starts=st.lists(st.floats(min_value=0.0, max_value=1.5), min_size=20, max_size=60),
    works=st.lists(st.floats(min_value=0.0, max_value=2.0), min_size=20, max_size=60),
)
def test_at_a_job_a_tick_or_more_no_two_ticks_in_a_row_send_nothing(
    starts: list[float], works: list[float]
) -> None:
    """Ticks start up to 1.5 ticks after their deadline and end up to 2 ticks
    after their start (a loaded machine); the next starts at once if the one
    before ended past its deadline. Each tick spans at least half a tick, so
    at a rate of a job a tick or more, a tick that sends nothing is followed
    by one that sends (the recovery drill holds the oldest-due age to this)."""
    tick = DRILL.tick_seconds
    state = replace(initial_state(DRILL, now=T0), rate=6.0, ceiling=6.0, firm=True, deadline=T0)
    now, idle = T0, 0
    for late, work in zip(starts, works, strict=False):
        state, plan = pacer.tick_budget(state, now=now, inflight=0, params=DRILL)
        assert plan.next_deadline - now >= tick / 2 - 1e-9
        idle = idle + 1 if plan.budget == 0 else 0
        assert idle < 2, (now - T0, plan)
        ended = now + work * tick
        now = max(plan.next_deadline + late * tick, ended)


def test_deadlines_follow_the_schedule() -> None:
    assert next_deadline(10.0, 10.3, 1.0) == 11.0
    assert next_deadline(10.0, 12.5, 1.0) == 13.0  # 11 and 12 were missed: skipped
    assert next_deadline(10.0, 9.9, 1.0) == 11.0  # called early: still on schedule


SLOW = replace(P, min_rate=0.01, max_rate=0.2)  # a destination held at 0.2 jobs/s


def ticks_on_schedule(
    state: PacerState, seconds: float, params: PacingParams
) -> list[tuple[float, int]]:
    """(time, budget) of every tick run at its plan's deadline for ``seconds``
    after the first, each previous tick's budget used (the backlog is deep)."""
    now, demand, out = state.last_tick, None, []
    end = now + seconds
    while now <= end + 1e-9:
        state, plan = plan_tick(state, EMPTY, demand, now=now, inflight=0, params=params)
        out.append((now, plan.budget))
        demand = full(plan.budget)
        now = plan.next_deadline
    return out


def test_a_tick_with_no_whole_job_to_send_skips_to_the_one_that_has_one() -> None:
    state = replace(initial_state(SLOW, now=T0), rate=0.2, ceiling=0.2, firm=True)
    ticks = ticks_on_schedule(state, 60.0, SLOW)
    budgets = [b for _, b in ticks]
    # 0.2 jobs/s: one job every 5 s, one tick for each (not five), the same jobs
    assert sum(budgets) == pytest.approx(0.2 * 60, abs=1)
    assert len(ticks) <= 0.2 * 60 + 2
    assert budgets.count(0) <= 1  # only the first, which had no credit yet
    times = [t for t, _ in ticks]
    assert all(
        later - earlier == pytest.approx(5.0) for earlier, later in itertools.pairwise(times[1:])
    )


def test_a_sparse_skip_is_bounded_and_its_time_is_paid_and_counted() -> None:
    slower = replace(SLOW, max_rate=0.01)
    state = replace(initial_state(slower, now=T0), rate=0.01, ceiling=0.01, firm=True, hold_s=5.0)
    state, plan = plan_tick(state, EMPTY, None, now=T0, inflight=0, params=slower)
    assert plan.budget == 0
    assert plan.next_deadline - T0 == pytest.approx(pacer.SPARSE_MAX_TICKS * slower.tick_seconds)
    later = plan.next_deadline
    # the tick at the end of the skip counts (and pays for) the whole time since
    assert pacer._elapsed(state, later, slower) == pytest.approx(later - T0)
    state, _ = plan_tick(state, EMPTY, None, now=later, inflight=0, params=slower)
    assert state.credit == pytest.approx(0.01 * (later - T0 + slower.tick_seconds))
    assert state.hold_s == 0.0  # the hold ran out over the skipped time too


@pytest.mark.parametrize("late", [0.0, 0.3, 0.6, 0.9])
def test_a_loop_running_late_does_not_starve_a_destination_under_a_job_a_tick(
    late: float,
) -> None:
    """Every tick starts ``late`` after its deadline (a busy loop): a late tick
    of a fast destination pays at most CATCH_UP x the rate over what is left
    of it, but one under a job a tick is paid all its time (a job, not a
    burst); capped, a loop 0.6 s late gave it half its rate."""
    state = replace(initial_state(SLOW, now=T0), rate=0.2, ceiling=0.2, firm=True)
    now, demand, jobs = T0, None, 0
    while now < T0 + 300.0:
        state, plan = plan_tick(state, EMPTY, demand, now=now, inflight=0, params=SLOW)
        jobs += plan.budget
        demand = full(plan.budget)
        now = plan.next_deadline + late
    assert jobs == pytest.approx(0.2 * 300.0, abs=2)


def test_a_tick_whose_rate_may_grow_a_pause_or_a_cool_down_stays_on_the_schedule() -> None:
    may_grow = replace(SLOW, max_rate=1.0)  # a used budget may grow the rate next tick
    state = replace(initial_state(may_grow, now=T0), rate=0.2, ceiling=0.2, firm=True, credit=0.9)
    _, plan = plan_tick(state, EMPTY, None, now=T0 + 1.0, inflight=0, params=may_grow)
    assert plan.budget == 1
    assert plan.next_deadline == pytest.approx(T0 + 2.0)
    # held at max_rate, it cannot: the next tick is the one with a whole job again
    _, plan = plan_tick(state, EMPTY, None, now=T0 + 1.0, inflight=0, params=SLOW)
    assert plan.budget == 1
    # it paid the 2 s since its last tick: credit 0.3 left, 0.2 a tick
    assert plan.next_deadline == pytest.approx(T0 + 5.0)
    for closed in ({"paused": True}, {"cooldown_remaining_s": 30.0}):
        _, plan = plan_tick(state, EMPTY, None, now=T0 + 1.0, inflight=0, params=SLOW, **closed)
        assert plan.budget == 0
        assert plan.next_deadline == pytest.approx(T0 + 2.0)


@pytest.mark.parametrize(
    ("budget", "live_due", "backlog_due", "expected"),
    [
        (10, 100, 100, (4, 6)),  # live_share 0.4 reserved
        (10, 1, 100, (1, 9)),  # unused reservation flows to the backlog
        (10, 100, 3, (7, 3)),  # and the backlog's to the live lane
        (10, 2, 3, (2, 3)),  # less due than budget
        (0, 5, 5, (0, 0)),
    ],
)
def test_lane_split_is_work_conserving(
    budget: int, live_due: int, backlog_due: int, expected: tuple[int, int]
) -> None:
    split = split_lanes(budget, live_due, backlog_due, P)
    assert (split.live, split.backlog) == expected


def test_publish_offsets_spread_the_tick_live_first_under_the_ceiling() -> None:
    _, plan = run(at_ceiling(rate=100.0, ceiling=100.0))
    offsets = publish_offsets(plan, 10, plan.budget)
    assert len(offsets) == plan.budget
    assert offsets == sorted(offsets)
    assert offsets[-1] <= plan.spacing_seconds * plan.budget + 1e-9
    live_gaps = {round(b - a, 9) for a, b in itertools.pairwise(offsets[:10])}
    assert live_gaps == {round(plan.live_spacing_seconds, 9)}
    assert plan.live_spacing_seconds > 1.0 / 100.0  # a pace under the ceiling


def test_a_claim_short_of_the_budget_goes_out_at_the_rates_pace() -> None:
    # the first of the budget's release points: a drain's last jobs end early,
    # not stretched over the tick at a pace under the rate
    _, plan = run(at_ceiling(rate=100.0, ceiling=100.0))
    assert plan.budget >= 50
    assert publish_offsets(plan, 0, 4) == pytest.approx(
        [i * plan.spacing_seconds for i in range(4)]
    )
    whole = publish_offsets(plan, 10, plan.budget)
    short = publish_offsets(plan, 10, 30)
    assert short == pytest.approx(whole[:30])
    assert short[-1] < 0.5 * plan.spacing_seconds * plan.budget


def test_a_short_claim_of_a_ramping_tick_follows_the_ramp_from_its_start() -> None:
    state = replace(initial_state(P, now=T0), rate=20.0)
    _, plan = run(state, OutcomeWindow(accepted=20, accepted_fresh=20), full(20))
    assert plan.ramp > 1.0
    whole = publish_offsets(plan, 0, plan.budget)
    short = publish_offsets(plan, 0, plan.budget // 3)
    assert short == pytest.approx(whole[: plan.budget // 3])


# --- growth -------------------------------------------------------------------


def test_slow_start_grows_by_its_factor_per_tick_while_accepted() -> None:
    state = replace(initial_state(P, now=T0), rate=20.0)
    state, _ = run(state, OutcomeWindow(accepted=20, accepted_fresh=20), full(20))
    assert state.rate == pytest.approx(20.0 * P.slow_start_factor)


def test_a_growing_slow_start_tick_ramps_on_to_the_next_ticks_rate() -> None:
    # the tick after growth releases from its rate up to what the next tick
    # grows to: the volume of the ramp, spread at a rising rate, no jump
    state = replace(initial_state(P, now=T0), rate=20.0)
    state, plan = run(state, OutcomeWindow(accepted=20, accepted_fresh=20), full(20))
    f = P.slow_start_factor
    rate = 20.0 * f  # the tick's rate, grown from 20
    assert plan.ramp == pytest.approx(f)
    # the volume of a ramp from that rate to f times it over the tick, not the rate
    assert plan.budget == math.floor(rate * (f - 1.0) / math.log(f))
    offsets = publish_offsets(plan, 0, plan.budget)
    gaps = [b - a for a, b in itertools.pairwise(offsets)]
    assert all(b < a for a, b in itertools.pairwise(gaps))  # ever closer together
    assert gaps[0] == pytest.approx(1.0 / rate, rel=0.05)  # the tick's rate at its start
    assert gaps[-1] == pytest.approx(1.0 / (rate * f), rel=0.05)  # the next tick's at its end
    assert pacer.ramp_rate(plan, 0.0) == rate
    assert pacer.ramp_rate(plan, plan.spacing_seconds * plan.budget) == pytest.approx(rate * f)
    # the next tick, had it grown on: its rate is where the ramp ended
    window = OutcomeWindow(accepted=plan.budget, accepted_fresh=plan.budget)
    after, _ = run(state, window, full(plan.budget))
    assert after.rate == pytest.approx(rate * f)


def slow_upstream(latency_ticks: int, ticks: int, *, capacity: float = 1e9) -> list[PacerState]:
    """Ticks of a destination whose calls take ``latency_ticks`` ticks (each
    tick's jobs are heard, accepted up to ``capacity`` a tick, that many ticks
    later), its backlog never empty: the state after each tick."""
    state, demand = initial_state(P, now=T0), None
    sent: list[int] = []
    states = []
    for k in range(ticks):
        back = k - latency_ticks
        heard = sent[back] if back >= 0 else 0
        accepted = min(heard, int(capacity))
        window = OutcomeWindow(
            accepted=accepted,
            accepted_fresh=accepted,
            refused=heard - accepted,
            refused_fresh=heard - accepted,
        )
        inflight = sum(sent[max(0, back + 1) :])
        state, plan = run(state, window, demand, inflight=inflight)
        sent.append(plan.budget)
        demand = full(plan.budget)
        states.append(state)
    return states


def test_slow_start_measures_a_round_trip_longer_than_a_tick_and_grows() -> None:
    # calls of three ticks keep three ticks of the rate in flight: over
    # INFLIGHT_RTTS ticks of it, so growth waited for a round trip measured
    # at a cut, and slow start, which has none, stayed at initial_rate
    states = slow_upstream(3, 30)
    assert states[2].round_trip_s == 0.0  # nothing heard yet: still waiting
    assert states[3].round_trip_s == pytest.approx(3.0)  # the first tick's jobs, heard
    assert states[-1].rate > 10 * P.initial_rate
    assert states[-1].ceiling is None  # grown in slow start, nothing refused
    # never faster than slow_start_factor per round trip
    for before, after in itertools.pairwise(states[3:]):
        assert after.rate <= before.rate * P.slow_start_factor ** (1.0 / 3.0) + 1e-9


def test_slow_start_grows_past_two_round_trips_in_flight_while_the_outcomes_keep_up() -> None:
    # calls of ~20 s whose fastest came back after 9 s: 200 in flight at 10/s
    # is over two measured round trips of the rate (180), yet the outcomes
    # come back at the rate: that is latency, not work piling up
    state = replace(initial_state(P, now=T0), rate=10.0, round_trip_s=9.0)
    grown, _ = run(state, OutcomeWindow(accepted=10, accepted_fresh=10), full(10), inflight=200)
    assert grown.rate > 10.0
    # the same in flight while only half the rate comes back: it piles up
    held, _ = run(state, OutcomeWindow(accepted=5, accepted_fresh=5), full(10), inflight=200)
    assert held.rate == 10.0
    # under the bound, growth needs no such evidence
    small, _ = run(state, OutcomeWindow(accepted=5, accepted_fresh=5), full(10), inflight=100)
    assert small.rate > 10.0
    # past slow start the bound stands (test_no_growth_while_work_piles_up_in_flight)
    past = replace(state, ceiling=20.0, firm=True)
    kept, _ = run(past, OutcomeWindow(accepted=10, accepted_fresh=10), full(10), inflight=200)
    assert kept.rate == 10.0


def test_a_first_round_trip_longer_than_its_bound_is_taken_as_the_bound() -> None:
    # nothing heard for a minute is an outage, not a latency to pace by
    states = slow_upstream(60, 62)
    assert states[59].round_trip_s == 0.0
    assert states[60].round_trip_s == pacer.FIRST_ROUND_TRIP_MAX_S


def test_a_round_trip_within_a_tick_is_not_measured_before_a_cut() -> None:
    # outcomes heard by the next tick: the round trip counts as the tick, as before
    states = slow_upstream(1, 8)
    assert all(s.round_trip_s == 0.0 and s.waiting_s == 0.0 for s in states)
    assert states[-1].rate > states[0].rate


def test_slow_start_ramps_only_while_it_grows() -> None:
    # a held tick (the accepted rate under the factor's reach) releases evenly
    state = replace(initial_state(P, now=T0), rate=20.0)
    _, plan = run(state, OutcomeWindow(accepted=5, accepted_fresh=5), full(20))
    assert (plan.ramp, plan.budget) == (1.0, 20)
    # past slow start: evenly
    _, plan = run(at_ceiling(rate=100.0), OutcomeWindow(accepted=100, accepted_fresh=100))
    assert plan.ramp == 1.0


def test_a_ramp_stops_at_max_rate_and_needs_time_to_pay_for() -> None:
    # growth up to max_rate: no room to ramp, the tick releases evenly
    top = replace(P, max_rate=30.0)
    state = replace(initial_state(top, now=T0), rate=20.0)
    state, plan = run(state, OutcomeWindow(accepted=20, accepted_fresh=20), full(20), params=top)
    assert (state.rate, plan.ramp, plan.budget) == (30.0, 1.0, 30)
    # part of the way: the ramp ends at max_rate
    near = replace(P, max_rate=33.0)
    state = replace(initial_state(near, now=T0), rate=20.0)
    state, plan = run(state, OutcomeWindow(accepted=20, accepted_fresh=20), full(20), params=near)
    assert pacer.ramp_rate(plan, plan.spacing_seconds * plan.budget) == pytest.approx(33.0)
    # a growing tick that pays for no time (run again at once) releases nothing
    state, plan = pacer.tick_budget(state, now=state.last_tick, inflight=0, params=P, growth=2.0)
    assert (plan.budget, plan.ramp) == (0, 1.0)


def test_slow_start_ends_at_what_its_ramp_accepted_not_at_the_rate_it_started_from() -> None:
    # a tick ramped from 30/s and sent 48 jobs; 8 of them refused: slow start
    # ends, its rate and ceiling just under the 40/s accepted (the upstream
    # took that much: back at 30/s, a fifth of the capacity would go unused
    # while the rate climbed back to its ceiling)
    state = replace(initial_state(P, now=T0), rate=30.0)
    window = OutcomeWindow(accepted=40, refused=8, accepted_fresh=40, refused_fresh=8)
    after, _ = run(state, window, full(48))
    assert after.ceiling == pytest.approx(40.0 * (1 - P.decrease_margin))
    assert after.rate == pytest.approx(after.ceiling)


def test_a_brake_on_a_ramp_measures_the_rate_released_by_then() -> None:
    state = replace(initial_state(P, now=T0), rate=100.0)
    heard = OutcomeWindow(accepted_fresh=38, refused_fresh=22)
    cut = pacer.brake(state, heard, P, sent=140.0)
    assert cut is not None
    assert cut.rate == pytest.approx(140.0 * (38 + 0.5) / 61 * (1 - P.decrease_margin))
    assert cut.cut_from == 140.0


def test_slow_start_is_paced_by_the_accepted_rate() -> None:
    state = replace(initial_state(P, now=T0), rate=20.0)
    state, _ = run(state, OutcomeWindow(accepted=5, accepted_fresh=5), full(20))
    assert P.slow_start_factor * 5 < 20
    assert state.rate == pytest.approx(20.0)  # the factor x 5/s accepted is below the rate


def test_slow_start_grows_per_second_not_per_tick() -> None:
    # at a 0.5 s tick, two ticks grow as much as one tick of 1 s: the factor, not its square
    p = replace(P, tick_seconds=0.5)
    state = replace(initial_state(p, now=T0), rate=40.0)
    for _ in range(2):  # everything sent was accepted
        n = round(state.rate * 0.5)
        window = OutcomeWindow(accepted=n, accepted_fresh=n, interval_seconds=0.5)
        state, _ = run(state, window, full(n), dt=0.5, params=p)
    assert state.ceiling is None
    assert state.rate == pytest.approx(40.0 * P.slow_start_factor)


def test_slow_start_holds_on_a_few_refusals_and_ends_on_evidence_at_the_accepted_rate() -> None:
    # 5 of 20 refused: a sample this small may be a burst or another sender's
    # probe: slow start goes on, but does not grow into them
    state = replace(initial_state(P, now=T0), rate=20.0)
    few = OutcomeWindow(accepted=15, refused=5, accepted_fresh=15, refused_fresh=5)
    after, _ = run(state, few, full(20))
    assert (after.rate, after.ceiling, after.epoch) == (20.0, None, 0)
    # 5 of 100 refused at 120/s: evidence enough; the rate drops to the 95/s
    # accepted (not to 120 x 95 %, nor to a quarter of the rate)
    state = replace(initial_state(P, now=T0), rate=120.0)
    window = OutcomeWindow(accepted=95, refused=5, accepted_fresh=95, refused_fresh=5)
    after, _ = run(state, window, full(120))
    assert after.epoch == 1
    assert after.rate == pytest.approx(95.0 * (1 - P.decrease_margin))
    assert after.ceiling == pytest.approx(after.rate)


def test_slow_start_ends_at_the_measured_rate_not_at_its_overshoot() -> None:
    # the rate grew to 150/s while outcomes of jobs sent at 120/s came back, 100/s
    # of them accepted: the rate drops to what was accepted, not to 150 x 100/120
    state = replace(initial_state(P, now=T0), rate=150.0, delivered=100.0)
    window = OutcomeWindow(accepted=100, refused=20, accepted_fresh=100, refused_fresh=20)
    after, _ = run(state, window, full(150))
    assert after.ceiling is not None
    assert after.rate == pytest.approx(100.0 * (1 - P.decrease_margin))
    assert after.rate <= 1.3 * 100.0


def test_a_ramping_slow_start_tick_refused_a_little_holds_at_what_it_accepted() -> None:
    # a tick ramped from 55/s to 165/s, sending 101 jobs; 6 of the 98 outcomes
    # refused (too few to end slow start): the rate holds at the 92/s accepted,
    # not at the 55/s the ramp began at (a second at 55 % of the capacity)
    state = replace(initial_state(P, now=T0), rate=55.0)
    window = OutcomeWindow(accepted=92, refused=6, accepted_fresh=92, refused_fresh=6)
    after, plan = run(state, window, full(101))
    assert (after.ceiling, after.epoch) == (None, 0)
    assert after.rate == pytest.approx(92.0)
    assert plan.ramp == 1.0  # held: no growth within the tick either
    # never above what was sent, nor under the rate it had
    low = OutcomeWindow(accepted=40, refused=6, accepted_fresh=40, refused_fresh=6)
    after, _ = run(state, low, full(101))
    assert after.rate == 55.0


def test_slow_start_holds_on_a_refusal_under_the_episode_threshold() -> None:
    # one refusal in 200 outcomes is no episode, but the upstream is full: no growth
    state = replace(initial_state(P, now=T0), rate=200.0, delivered=199.0)
    one = OutcomeWindow(accepted=199, refused=1, accepted_fresh=199, refused_fresh=1)
    after, _ = run(state, one, full(200))
    assert (after.rate, after.ceiling, after.epoch) == (200.0, None, 0)


def test_slow_start_holds_when_the_accepted_rate_stops_growing_with_the_rate() -> None:
    # rate 100/s, accepted 80/s again (the average was 80/s): saturated, not lagging
    state = replace(initial_state(P, now=T0), rate=100.0, delivered=80.0)
    window = OutcomeWindow(accepted=80, accepted_fresh=80)
    after, _ = run(state, window, full(100))
    assert after.rate == 100.0
    # still growing (80/s after an average of 60/s): only outcomes on their way
    growing = replace(state, delivered=60.0)
    after, _ = run(growing, window, full(100))
    assert after.rate > 100.0


def test_slow_start_holds_when_the_accepted_rate_grows_slower_than_the_rate() -> None:
    # the window before accepted 60/s, this one 70/s: above the average (50/s),
    # yet far short of the rate's growth (threefold a round trip)
    state = replace(initial_state(P, now=T0), rate=180.0, delivered=50.0, window_rate=60.0)
    window = OutcomeWindow(accepted=70, accepted_fresh=70)
    after, _ = run(state, window, full(180))
    assert (after.rate, after.ceiling, after.flat) == (180.0, None, True)
    # grown by more than the square root of the rate's factor (60 x 3 ** 0.5 =
    # 103.9): outcomes still on their way, slow start grows on
    growing = OutcomeWindow(accepted=110, accepted_fresh=110)
    after, _ = run(state, growing, full(180))
    assert after.rate > 180.0
    assert not after.flat


def test_slow_start_ends_at_what_comes_back_after_two_flat_windows_on_a_short_round_trip() -> None:
    # workers that call 70 a second whatever the rate, nothing refused: slow
    # start holds on the first flat window and ends on the second, at what
    # they pass (every tick held at the rate piled up more work before them)
    state = replace(initial_state(P, now=T0), rate=180.0, delivered=50.0, window_rate=60.0)
    window = OutcomeWindow(accepted=70, accepted_fresh=70)
    held, _ = run(state, window, full(180), inflight=200)
    assert held.ceiling is None
    ended, _ = run(held, window, full(180), inflight=300)
    low = 70.0 * (1.0 - P.decrease_margin)
    assert ended.rate == pytest.approx(low)
    assert ended.ceiling == pytest.approx(low)
    assert ended.firm
    assert ended.epoch == held.epoch  # nothing refused: no cut
    # max_inflight reached (no evidence for growth): it ends all the same
    capped = Demand(budget=180, admitted=100, inflight_capped=True)
    ended, _ = run(held, window, capped, inflight=2000)
    assert ended.ceiling == pytest.approx(low)
    # a tick with less to send than the rate (app-limited) says nothing of it
    short = Demand(budget=180, admitted=70, backlog_empty=True)
    kept, _ = run(held, window, short, inflight=100)
    assert (kept.ceiling, kept.rate, kept.flat) == (None, 180.0, False)


def test_on_a_long_round_trip_flat_windows_only_hold_slow_start() -> None:
    # calls slower than a tick: what is heard lags the rate by round trips and
    # spreads over ticks, so a flat window says too little to end slow start on
    state = replace(
        initial_state(P, now=T0), rate=180.0, delivered=50.0, window_rate=60.0, round_trip_s=3.0
    )
    window = OutcomeWindow(accepted=70, accepted_fresh=70)
    held, _ = run(state, window, full(180), inflight=500)
    again, _ = run(held, window, full(180), inflight=500)
    assert (held.rate, held.flat) == (180.0, True)
    assert (again.rate, again.ceiling) == (180.0, None)


def test_a_refusal_under_the_threshold_at_the_ceiling_stops_a_ladder() -> None:
    # climbing a stale ceiling with doubling steps, then one refusal: the
    # upstream was empty at that moment, so the evidence of growth is void
    state = replace(at_ceiling(rate=120.0, ceiling=100.0), ladder=4.8, saved=10.0, surplus=900.0)
    window = OutcomeWindow(accepted=119, refused=1, accepted_fresh=119, refused_fresh=1)
    after, _ = run(state, window, full(120))
    assert (after.rate, after.epoch) == (120.0, 7)  # held, not cut
    assert (after.ladder, after.saved, after.surplus) == (0.0, 0.0, 0.0)


def clean(rate: float) -> OutcomeWindow:
    """A tick's window of outcomes at ``rate``, none refused."""
    return OutcomeWindow(accepted=round(rate), accepted_fresh=round(rate))


def test_a_clean_tick_with_demand_adds_the_increase_step() -> None:
    state, _ = run(at_ceiling(rate=50.0, ceiling=100.0), clean(50), full(50))
    assert state.rate > 50.0  # far under the ceiling: recovers faster than a step
    state, _ = run(at_ceiling(rate=99.9, ceiling=100.0), clean(100), full(100))
    assert state.rate == pytest.approx(100.0)
    state, _ = run(at_ceiling(rate=100.0, ceiling=100.0), clean(100), full(100))
    assert state.rate == pytest.approx(100.0 + P.increase_step)


@pytest.mark.parametrize(
    "demand",
    [
        None,
        Demand(budget=100, admitted=40, backlog_empty=True),
        Demand(budget=100, admitted=100, inflight_capped=True),
        Demand(budget=0, admitted=0),
    ],
)
def test_an_idle_or_app_limited_destination_does_not_grow(demand: Demand | None) -> None:
    state, _ = run(at_ceiling(rate=100.0), OutcomeWindow(accepted=40, accepted_fresh=40), demand)
    assert state.rate == 100.0


def test_paused_admits_nothing_and_does_not_grow() -> None:
    state, plan = run(at_ceiling(), EMPTY, full(100), paused=True)
    assert (plan.budget, plan.paused, state.rate, state.credit) == (0, True, 100.0, 0.0)


def test_a_stale_ceiling_is_climbed_with_doubling_steps() -> None:
    state = replace(at_ceiling(rate=30.0, ceiling=30.0), saved=0.0)
    steps, budget = [], 30
    for _ in range(14):
        before = state.rate
        state, plan = run(state, clean(before), full(budget))  # what the last tick sent
        steps.append(state.rate - before)
        budget = plan.budget
    # one step a round trip until what was sent above the ceiling exceeds what
    # the upstream could have stored by twice the estimate's slack, then doubling
    assert steps[0] == pytest.approx(P.increase_step)
    assert all(b >= a - 1e-9 for a, b in itertools.pairwise(steps))
    assert steps[-1] >= 8 * P.increase_step  # the upstream has grown: find it fast


def test_clean_round_trips_at_a_firm_ceiling_start_the_ladder() -> None:
    # saved is huge: the surplus test alone would not call this ceiling stale
    # for minutes; PROBE_RTTS clean round trips at or above it with demand do
    state, steps = at_ceiling(rate=90.0, ceiling=90.0), []
    for _ in range(int(pacer.PROBE_RTTS) + 3):
        before = state.rate
        window = OutcomeWindow(accepted=round(before), accepted_fresh=round(before))
        state, _ = run(state, window, full(round(before)))
        steps.append(state.rate - before)
    probe = int(pacer.PROBE_RTTS) - 1
    assert steps[:probe] == pytest.approx([P.increase_step] * probe)
    assert state.ladder > 0
    assert steps[-1] >= 4 * P.increase_step  # doubling: the ceiling is probed, fast


def test_a_refusal_restarts_the_clean_time_before_a_probe() -> None:
    state = replace(at_ceiling(rate=90.0, ceiling=90.0), clean_s=pacer.PROBE_RTTS - 1.0)
    window = OutcomeWindow(accepted=89, refused=1, accepted_fresh=89, refused_fresh=1)
    state, _ = run(state, window, full(90))  # under the episode threshold: held
    assert (state.clean_s, state.ladder, state.epoch) == (0.0, 0.0, 7)
    for _ in range(int(pacer.PROBE_RTTS) - 1):
        state, _ = run(state, OutcomeWindow(accepted=90, accepted_fresh=90), full(90))
    assert state.ladder == 0.0  # not yet: the clean time starts again


def test_a_mild_cut_never_goes_under_what_the_upstream_accepted() -> None:
    # a burst of prefetched work reached a small bucket: 10 of 105 refused,
    # but the upstream accepted 95/s in the window and on average
    state = replace(at_ceiling(rate=100.0, ceiling=100.0), delivered=95.0)
    window = OutcomeWindow(accepted=95, refused=10, accepted_fresh=95, refused_fresh=10)
    after, _ = run(state, window, full(100))
    assert after.epoch == 8
    assert after.rate == pytest.approx(95.0 * (1 - P.decrease_margin))
    assert after.ceiling == pytest.approx(95.0 * (1 - P.decrease_margin))
    # a drop: the window accepted far less than the average (which lags it);
    # the refusals beyond the two that called the episode measure the excess
    window = OutcomeWindow(accepted=60, refused=10, accepted_fresh=60, refused_fresh=10)
    after, _ = run(replace(state, delivered=99.0), window, full(100))
    share = 100.0 * (1 - (10 - P.refusal_min_count) / 70)
    assert after.rate == pytest.approx(share * (1 - P.decrease_margin))


# --- cuts ---------------------------------------------------------------------


def test_an_episode_cuts_to_just_under_the_accepted_rate() -> None:
    # 5 refusals in 100, 2 of them the episode's trigger: 3 % over the capacity
    window = OutcomeWindow(accepted=95, refused=5, accepted_fresh=95, refused_fresh=5)
    state, _ = run(at_ceiling(rate=100.0, ceiling=102.0), window, full(100))
    assert state.rate == pytest.approx(97.0 * (1 - P.decrease_margin))
    assert state.rate < 95.0  # under what the upstream accepted
    # the remembered ceiling is just under the measure too: a proportional part
    # in every cut, which is what brings senders sharing an upstream together
    assert state.ceiling == pytest.approx(97.0 * (1 - P.decrease_margin))
    assert state.epoch == 8


def test_senders_sharing_an_upstream_lose_the_same_share_at_the_trigger() -> None:
    # two senders, 40/s and 80/s, each cut on the refusals that call an episode
    # (the count floor): the same share off both, not the same jobs/s, which
    # would take a larger share off the smaller one and hold their shares apart
    called = P.refusal_min_count
    small, large = at_ceiling(rate=40.0, ceiling=40.0), at_ceiling(rate=80.0, ceiling=80.0)
    at_trigger = OutcomeWindow(
        accepted=40 - called, refused=called, accepted_fresh=40 - called, refused_fresh=called
    )
    small_after, _ = run(small, at_trigger, full(40))
    at_trigger = OutcomeWindow(
        accepted=80 - called, refused=called, accepted_fresh=80 - called, refused_fresh=called
    )
    large_after, _ = run(large, at_trigger, full(80))
    assert (small_after.epoch, large_after.epoch) == (8, 8)
    assert small_after.rate / 40.0 == pytest.approx(large_after.rate / 80.0)
    assert small_after.rate == pytest.approx(40.0 * (1 - P.decrease_margin))
    # at an equal refusal ratio (5 %) the larger one loses the larger share
    ratio = OutcomeWindow(accepted=76, refused=4, accepted_fresh=76, refused_fresh=4)
    large_after, _ = run(large, ratio, full(80))
    assert large_after.rate / 80.0 < small_after.rate / 40.0


def test_refusals_under_the_count_floor_do_not_cut_but_hold() -> None:
    window = OutcomeWindow(accepted=99, refused=1, accepted_fresh=99, refused_fresh=1)
    state, _ = run(at_ceiling(rate=101.0, ceiling=100.0), window, full(101))
    assert (state.rate, state.epoch) == (101.0, 7)


def test_refusals_under_the_threshold_tick_after_tick_add_up_to_an_episode() -> None:
    # a rate held a little over a 30/s capacity: one refusal a tick, never two
    one = OutcomeWindow(accepted=29, refused=1, accepted_fresh=29, refused_fresh=1)
    state, _ = run(at_ceiling(rate=30.6, ceiling=30.0), one, full(30))
    assert state.epoch == 7  # one refusal in 30: held
    state, _ = run(state, one, full(30))
    assert state.epoch == 7  # 1.8 in 53 once decayed: not yet
    state, _ = run(state, one, full(30))
    assert state.epoch == 8  # 2.4 in 72 (3.3 % >= refusal_threshold): an episode
    # they are the episode's trigger, no excess beyond it: the cut is the margin
    assert state.rate == pytest.approx(30.6 * (1 - P.decrease_margin), rel=0.01)
    assert (state.acc_refused, state.acc_outcomes) == (0.0, 0.0)


def test_refusals_far_apart_do_not_add_up() -> None:
    one = OutcomeWindow(accepted=29, refused=1, accepted_fresh=29, refused_fresh=1)
    state, _ = run(at_ceiling(rate=30.6, ceiling=30.0), one, full(30))
    state, _ = run(state, one, full(30), dt=10 * pacer.ACCUMULATE_S)
    assert state.epoch == 7


def test_a_brake_cuts_mid_tick_to_the_accepted_share_and_ends_slow_start() -> None:
    state = replace(initial_state(P, now=T0), rate=160.0)  # slow start, capacity ~100
    heard = OutcomeWindow(accepted_fresh=38, refused_fresh=22)
    cut = pacer.brake(state, heard, P)
    assert cut is not None
    share = (38 + 0.5) / 61
    assert cut.rate == pytest.approx(160.0 * share * (1 - P.decrease_margin))
    assert 95.0 <= cut.rate <= 105.0
    assert cut.ceiling is not None  # slow start is over
    assert (cut.epoch, cut.episode, cut.braked, cut.heavy) == (1, True, True, False)


def test_a_brake_cuts_to_the_accepted_rate_when_the_ramp_ran_ahead_of_its_outcomes() -> None:
    # the ramp is at 400/s by now, but the outcomes heard left when it was
    # lower: 30 accepted and 6 refused over the 0.25 s since the last clean
    # reading, a refill rate of about 120/s (400 x their share would be 330/s)
    state = replace(initial_state(P, now=T0), rate=200.0)
    heard = OutcomeWindow(accepted=30, accepted_fresh=30, refused_fresh=6, interval_seconds=0.25)
    cut = pacer.brake(state, heard, P, sent=400.0)
    assert cut is not None
    assert cut.rate == pytest.approx(30.5 / 0.25 * (1 - P.decrease_margin))
    # a window too short, or too few outcomes, to measure a rate: the share of what was sent
    short = replace(heard, interval_seconds=pacer.BRAKE_MIN_SPAN_S / 2)
    n = pacer.BRAKE_MIN_ACCEPTED - 1
    few = OutcomeWindow(accepted=n, accepted_fresh=n, refused_fresh=6, interval_seconds=0.25)
    for thin in (short, few):
        cut = pacer.brake(state, thin, P, sent=400.0)
        assert cut is not None
        share = (thin.accepted_fresh + 0.5) / (thin.accepted_fresh + 7)
        assert cut.rate == pytest.approx(400.0 * share * (1 - P.decrease_margin))


def test_on_a_long_round_trip_a_brake_takes_the_refusals_share_of_what_was_sent() -> None:
    # calls of ~3 s, 429s at once: 0.12 s of outcomes are 4 refusals of what
    # was just sent (133/s) and 1 acceptance of what went out 3 s before; 4
    # in 5 refused is not the share of the 16 sent meanwhile
    window = OutcomeWindow(accepted=1, refused=4, accepted_fresh=1, refused_fresh=4,
                           interval_seconds=0.12)  # fmt: skip
    long = replace(initial_state(P, now=T0), rate=100.0, round_trip_s=3.0)
    cut = pacer.brake(long, window, P, sent=133.0)
    assert cut is not None
    n = 133.0 * 0.12
    assert cut.rate == pytest.approx(133.0 * (n - 3.5) / (n + 1.0) * (1.0 - P.decrease_margin))
    # outcomes heard within a tick of their release: their share, as before
    short = replace(long, round_trip_s=0.0)
    cut = pacer.brake(short, window, P, sent=133.0)
    assert cut is not None
    assert cut.rate == pytest.approx(P.decrease_factor * 133.0)


def test_on_a_long_round_trip_a_cut_takes_the_refusals_share_of_what_was_sent() -> None:
    # 10 refusals at once and 2 acceptances of calls sent ~3 s before, of the
    # 100 sent over the tick: a mild episode, not a heavy one of 10 in 12
    window = OutcomeWindow(accepted=2, refused=10, accepted_fresh=2, refused_fresh=10)
    long = replace(at_ceiling(), round_trip_s=3.0)
    after, _ = run(long, window, full(100))
    assert not after.heavy
    assert after.rate == pytest.approx(100.0 * (1.0 - 8.0 / 100.0) * (1.0 - P.decrease_margin))
    # a round trip within a tick: the window's outcomes are its sends
    short = replace(at_ceiling(), round_trip_s=1.0)
    after, _ = run(short, window, full(100))
    assert after.heavy
    assert after.rate == pytest.approx(P.decrease_factor * 100.0)


def test_a_brake_needs_many_refusals_making_a_large_share() -> None:
    state = replace(initial_state(P, now=T0), rate=100.0)
    few = OutcomeWindow(accepted_fresh=40, refused_fresh=pacer.BRAKE_MIN_FACTOR * 2 - 1)
    assert pacer.brake(state, few, P) is None
    small_share = OutcomeWindow(accepted_fresh=95, refused_fresh=5)
    assert pacer.brake(state, small_share, P) is None  # a burst: the tick decides
    assert pacer.brake(replace(state, cooling=True), OutcomeWindow(refused_fresh=50), P) is None
    many = OutcomeWindow(accepted_fresh=10, refused_fresh=10)
    assert pacer.brake(state, many, P) is not None


def test_past_slow_start_only_a_drops_share_of_refusals_brakes() -> None:
    state = at_ceiling(rate=100.0)
    # a probe's overshoot: a share over the slow-start brake's, under a drop's
    probe = OutcomeWindow(accepted_fresh=40, refused_fresh=8)
    assert pacer.BRAKE_RATIO * 48 <= 8 < pacer.BRAKE_DROP_RATIO * 48
    assert pacer.brake(state, probe, P) is None
    n = pacer.BRAKE_DROP_OUTCOMES - 1  # a drop's share among too few outcomes to tell
    assert (
        pacer.brake(state, OutcomeWindow(accepted_fresh=n - n // 2, refused_fresh=n // 2), P)
        is None
    )
    drop = OutcomeWindow(accepted_fresh=10, refused_fresh=10)
    cut = pacer.brake(state, drop, P)
    assert cut is not None
    assert cut.rate < state.rate
    # a capacity that fell: remembered as a peak, and the cuts that follow are not heavy
    assert (cut.peak, cut.dropped) == (100.0, True)
    assert not pacer.brake(replace(initial_state(P, now=T0), rate=100.0), drop, P).dropped  # type: ignore[union-attr]


def test_a_drop_most_of_whose_outcomes_are_refused_brakes_before_it_has_many() -> None:
    state = at_ceiling(rate=100.0)
    least = pacer.BRAKE_MIN_FACTOR * P.refusal_min_count
    # twice the brake's least refusals, half or more of what was heard: a drop already
    cut = pacer.brake(state, OutcomeWindow(accepted_fresh=4, refused_fresh=2 * least), P)
    assert cut is not None
    assert (cut.peak, cut.dropped) == (100.0, True)
    assert cut.rate < 50.0
    # fewer refusals, or under half of the outcomes: wait for BRAKE_DROP_OUTCOMES
    fewer = OutcomeWindow(accepted_fresh=1, refused_fresh=2 * least - 1)
    under_half = OutcomeWindow(accepted_fresh=2 * least + 1, refused_fresh=2 * least)
    assert fewer.accepted_fresh + fewer.refused_fresh < pacer.BRAKE_DROP_OUTCOMES
    assert under_half.accepted_fresh + under_half.refused_fresh < pacer.BRAKE_DROP_OUTCOMES
    assert pacer.brake(state, fewer, P) is None
    assert pacer.brake(state, under_half, P) is None


def test_a_ladders_overshoot_is_braked_to_just_under_the_rung_it_stepped_from() -> None:
    # the ladder stepped from 98.6/s, whose window was clean, to 123.3/s
    probe = replace(at_ceiling(rate=123.3, ceiling=80.0), ladder=24.7, peak=50.0)
    overshoot = OutcomeWindow(accepted_fresh=32, refused_fresh=10)  # a share under a drop's
    assert pacer.BRAKE_DROP_RATIO * 42 > 10
    cut = pacer.brake(probe, overshoot, P)
    assert cut is not None
    # the estimate (123.3 x 32.5 / 43 = 93.2, less the margin) is under the rung's
    assert cut.rate == pytest.approx(98.6 * (1 - P.decrease_margin))
    assert (cut.ceiling, cut.firm, cut.braked, cut.ladder) == (cut.rate, True, True, 0.0)
    # the capacity found above the rung did not fall: no peak, no drop
    assert (cut.peak, cut.dropped) == (50.0, False)
    # an estimate above the rung: just under it
    mild = OutcomeWindow(accepted_fresh=90, refused_fresh=10)
    higher = pacer.brake(probe, mild, P)
    assert higher is not None
    assert higher.rate == pytest.approx(123.3 * 90.5 / 101 * (1 - P.decrease_margin))
    assert 98.6 * (1 - P.decrease_margin) < higher.rate < 123.3
    # too few refusals to tell, or no ladder (the tick's own step decides)
    few = OutcomeWindow(accepted_fresh=40, refused_fresh=pacer.BRAKE_MIN_FACTOR * 2 - 1)
    assert pacer.brake(probe, few, P) is None
    assert pacer.brake(replace(probe, ladder=0.0), overshoot, P) is None


def test_a_drops_share_of_refusals_during_a_ladders_probe_is_a_drop() -> None:
    probe = replace(at_ceiling(rate=102.0, ceiling=97.0), ladder=2.4)
    n = pacer.BRAKE_DROP_OUTCOMES - 1  # too few outcomes to tell a drop: wait for more
    early = OutcomeWindow(accepted_fresh=n - n // 2, refused_fresh=n // 2)
    assert pacer.brake(probe, early, P) is None
    cut = pacer.brake(probe, OutcomeWindow(accepted_fresh=10, refused_fresh=10), P)
    assert cut is not None
    assert cut.rate < 102.0 - 2.4  # not back to the rung: the capacity fell
    assert (cut.peak, cut.dropped) == (102.0, True)  # remembered for its return


@pytest.mark.parametrize(
    ("inflight", "watched"), [(0, True), (10, True), (11, False), (500, False)]
)
def test_past_slow_start_a_tick_is_watched_only_when_its_round_trip_is_short(
    inflight: int, watched: bool
) -> None:
    # at 100/s, what is in flight at the tick's start took under a tenth of a tick to send
    assert pacer.watches(at_ceiling(rate=100.0), P, inflight=inflight) is watched
    slow_start = replace(initial_state(P, now=T0), rate=100.0)
    assert pacer.watches(slow_start, P, inflight=inflight)  # slow start: always
    assert not pacer.watches(replace(slow_start, cooling=True), P, inflight=0)


def test_after_slow_starts_brake_ticks_are_watched_on_any_round_trip_until_a_clean_window() -> None:
    # slow start braked at 419/s on its first refusals (the burst absorbed
    # the rest): a rough estimate, 252/s, still well over a capacity of 100/s
    ramp = replace(initial_state(P, now=T0), rate=189.0, round_trip_s=1.0)
    first = OutcomeWindow(accepted=31, accepted_fresh=31, refused_fresh=5, interval_seconds=0.12)
    braked = pacer.brake(ramp, first, P, sent=419.0)
    assert braked is not None
    assert braked.ceiling is not None
    assert braked.rate > 200.0
    assert braked.exited
    # a long round trip (300 jobs in flight at 252/s): a tick past slow start
    # would not be watched, this one is, and so are the ticks after it that
    # hear a refusal among their few fresh outcomes
    assert not pacer.watches(replace(braked, exited=False), P, inflight=300)
    assert pacer.watches(braked, P, inflight=300)
    few, _ = run(braked, OutcomeWindow(accepted=40, refused=38, accepted_fresh=1,
                                       refused_fresh=2), full(250))  # fmt: skip
    assert few.exited
    assert pacer.watches(few, P, inflight=300)
    # the tick releases evenly at that rate: the brake cuts on the share of
    # what it sent (14 of 30 accepted), not on the accepted rate since the
    # last clean reading (20 over 0.24 s, most of it before these outcomes came)
    heard = OutcomeWindow(accepted=20, accepted_fresh=14, refused_fresh=16, interval_seconds=0.24)
    cut = pacer.brake(few, heard, P)
    assert cut is not None
    share = (14 + 0.5) / 31
    assert cut.rate == pytest.approx(few.rate * share * (1 - P.decrease_margin))
    assert 95.0 <= cut.rate <= 115.0
    # an overshoot of slow start's making: no capacity fell, no peak to return to
    assert (cut.peak, cut.dropped) == (0.0, False)
    assert cut.exited
    # a clean window ends it: from there on a long round trip is not watched
    clean, _ = run(cut, OutcomeWindow(accepted=60, accepted_fresh=60), full(int(cut.rate)))
    assert not clean.exited
    assert not pacer.watches(clean, P, inflight=300)


def test_the_cuts_right_after_a_drops_brake_are_not_heavy_until_a_clean_window() -> None:
    state = pacer.brake(
        at_ceiling(rate=100.0), OutcomeWindow(accepted_fresh=10, refused_fresh=10), P
    )
    assert state is not None
    # the brake's rate was still over the capacity: a fifth refused, twice
    over = OutcomeWindow(accepted=40, refused=10, accepted_fresh=40, refused_fresh=10)
    assert pacer._heavy(10, 50, P)
    for _ in range(2):
        before = state.rate
        state, _ = run(state, over, full(int(state.rate)))
        assert not state.heavy
        assert state.rate > P.decrease_factor * before
        assert state.dropped
    state, _ = run(state, OutcomeWindow(accepted=40, accepted_fresh=40), full(int(state.rate)))
    assert not state.dropped  # a clean window: a later heavy episode is a new capacity change


def test_no_cut_right_after_a_brake_is_heavy() -> None:
    start = replace(initial_state(P, now=T0), rate=160.0)
    state = pacer.brake(start, OutcomeWindow(accepted_fresh=30, refused_fresh=20), P)
    assert state is not None
    # the next window: jobs claimed at the brake's rate, a third of them refused
    window = OutcomeWindow(accepted=20, refused=10, accepted_fresh=20, refused_fresh=10)
    after, _ = run(state, window, full(int(state.rate)))
    assert not after.heavy
    sent = state.rate
    excess = (10 - P.refusal_min_count) / 30  # beyond the refusals that called it
    assert after.rate == pytest.approx(sent * (1 - excess) * (1 - P.decrease_margin), rel=0.01)
    assert after.rate > P.decrease_factor * sent


def test_one_cut_per_round_trip() -> None:
    episode = OutcomeWindow(accepted=90, refused=10, accepted_fresh=90, refused_fresh=10)
    state, _ = run(at_ceiling(rate=100.0), episode, full(100))
    cut = state.rate
    # outcomes of jobs admitted before the cut: refused, but stale
    stale = OutcomeWindow(accepted=80, refused=20)
    state, _ = run(state, stale, full(88))
    assert (state.rate, state.epoch) == (cut, 8)
    # jobs admitted after the cut are refused too: that is a new round trip
    fresh = OutcomeWindow(accepted=80, refused=10, accepted_fresh=80, refused_fresh=10)
    state, _ = run(state, fresh, full(88))
    assert state.rate < cut
    assert state.epoch == 9


def test_no_cut_goes_below_the_decrease_factor() -> None:
    window = OutcomeWindow(accepted=1, refused=99, accepted_fresh=1, refused_fresh=99)
    state, _ = run(at_ceiling(rate=100.0), window, full(100))
    assert state.rate == pytest.approx(P.decrease_factor * 100.0)


def test_a_heavy_episode_is_refined_up_by_the_stale_outcomes_of_its_round_trip() -> None:
    # capacity fell from 100/s to 35/s within the window: its estimate (66/s) is
    # only a bound, so the rate drops to the floor ...
    window = OutcomeWindow(accepted=66, refused=34, accepted_fresh=66, refused_fresh=34)
    state, _ = run(at_ceiling(rate=100.0), window, full(100))
    assert state.rate == pytest.approx(25.0)
    # ... and the outcomes of jobs sent at 100/s before the cut measure 35/s
    stale = OutcomeWindow(accepted=35 + 15, refused=65, accepted_fresh=15)
    state, _ = run(state, stale, full(25))
    assert 25.0 < state.rate < 35.0
    assert state.ceiling == pytest.approx(100.0 * 35.5 / 101.0)


def _heavy_then_fresh(state: PacerState) -> tuple[PacerState, TickPlan, float]:
    """A heavy window (16 refusals in 70) at 85/s, then a window of fresh
    outcomes only: the round trip was far shorter than the tick, so every
    outcome of the jobs sent before the cut was in the heavy window."""
    window = OutcomeWindow(accepted=54, refused=16, accepted_fresh=54, refused_fresh=16)
    state, plan = run(state, window, full(85))
    bound = 85.0 * 54 / 70
    assert state.heavy
    assert (state.rate, state.ceiling) == pytest.approx((21.25, bound))  # the floor; a bound
    state, plan = run(state, OutcomeWindow(accepted=21, accepted_fresh=21), full(plan.budget))
    assert not state.episode
    assert state.rate == pytest.approx(21.25)  # the first fresh window only ends the episode
    return state, plan, bound


def _clean_ticks(state: PacerState, plan: TickPlan, ticks: int) -> list[float]:
    rates = []
    for _ in range(ticks):
        fresh = OutcomeWindow(accepted=plan.budget, accepted_fresh=plan.budget)
        state, plan = run(state, fresh, full(plan.budget))
        rates.append(state.rate)
    return rates


def test_a_probes_heavy_cut_left_unrefined_regrows_toward_its_bound_per_round_trip() -> None:
    # a ladder probing from a ceiling of 30/s met the capacity at 85/s
    probing = replace(at_ceiling(rate=85.0, ceiling=30.0), ladder=8.0)
    state, plan, bound = _heavy_then_fresh(probing)
    assert state.regrow
    low = bound * (1.0 - P.decrease_margin)
    # by half again per round trip up to just under the bound, then by the step
    grown = [21.25 * pacer.REGROW, 21.25 * pacer.REGROW**2, low, low + P.increase_step]
    assert _clean_ticks(state, plan, 4) == pytest.approx(grown)


def test_a_probes_heavy_window_that_accepted_its_last_step_cuts_just_under_it() -> None:
    # a ladder over a drop's ceiling of 30/s: 79/s held clean, then a step to
    # 98.6/s met a small bucket's bursts (14 of 80 refused, a heavy share);
    # what the window accepted (81/s) is above where the last step began:
    # an overshoot of the capacity it found, not a capacity that fell, so no
    # floor at a quarter of the rate (a real deep cut lost seconds there)
    probing = replace(at_ceiling(rate=98.6, ceiling=30.0), ladder=19.7)
    window = OutcomeWindow(accepted=66, refused=14, accepted_fresh=66, refused_fresh=14)
    assert pacer._heavy(14, 80, P)
    state, _ = run(probing, window, full(99))
    est = 98.6 * 66 / 80
    assert est >= 98.6 - 19.7
    assert state.rate == pytest.approx(est * (1.0 - P.decrease_margin))
    assert state.ceiling == pytest.approx(est)
    # one that accepted less than where its last step began fell to the floor as before
    low = OutcomeWindow(accepted=50, refused=30, accepted_fresh=50, refused_fresh=30)
    state, _ = run(probing, low, full(99))
    assert state.rate == pytest.approx(P.decrease_factor * 98.6)


def test_a_regrowths_step_refused_heavily_regrows_again_toward_its_new_bound() -> None:
    # regrowing from a probe's cut, a step overshot the capacity: not a drop
    # (the rate had just been raised), so the new floor regrows too instead
    # of climbing by the step from a quarter of the rate
    probing = replace(at_ceiling(rate=85.0, ceiling=30.0), ladder=8.0)
    state, plan, _ = _heavy_then_fresh(probing)
    state, plan = run(state, OutcomeWindow(accepted=21, accepted_fresh=21), full(plan.budget))
    assert state.regrow
    assert state.rate == pytest.approx(21.25 * pacer.REGROW)
    sent = state.rate
    window = OutcomeWindow(accepted=24, refused=8, accepted_fresh=24, refused_fresh=8)
    state, plan = run(state, window, full(plan.budget))
    assert (state.heavy, state.regrow) == (True, True)
    assert state.rate == pytest.approx(P.decrease_factor * sent)
    state, plan = run(state, OutcomeWindow(accepted=8, accepted_fresh=8), full(plan.budget))
    grown = _clean_ticks(state, plan, 2)
    assert grown[0] == pytest.approx(state.rate * pacer.REGROW)


def test_a_drops_heavy_cut_left_unrefined_climbs_by_the_step() -> None:
    # no probe: the capacity fell within the window, whose bound mixes before and after
    state, plan, _ = _heavy_then_fresh(at_ceiling(rate=85.0, ceiling=85.0))
    assert not state.regrow
    steps = [21.25 + 2 * P.increase_step * k for k in (1, 2, 3)]
    assert _clean_ticks(state, plan, 3) == pytest.approx(steps)


def test_the_cut_that_ends_a_heavy_cuts_episode_is_never_heavy() -> None:
    # the capacity fell under the floor the heavy cut sent at: 6 of the 22
    # first fresh outcomes refused measure it; a second floor would compound the first
    window = OutcomeWindow(accepted=54, refused=16, accepted_fresh=54, refused_fresh=16)
    state, plan = run(at_ceiling(rate=85.0, ceiling=85.0), window, full(85))
    assert (state.heavy, state.episode) == (True, True)
    assert state.rate == pytest.approx(21.25)
    again = OutcomeWindow(accepted=16, refused=6, accepted_fresh=16, refused_fresh=6)
    assert pacer._heavy(6, 22, P)
    state, plan = run(state, again, full(plan.budget))
    assert not state.heavy
    est = 21.25 * (1.0 - (6 - P.refusal_min_count) / 22)
    assert state.rate == pytest.approx(est * (1.0 - P.decrease_margin))


def test_a_probes_heavy_cut_refined_by_its_stale_outcomes_does_not_regrow() -> None:
    window = OutcomeWindow(accepted=66, refused=34, accepted_fresh=66, refused_fresh=34)
    state, plan = run(replace(at_ceiling(rate=100.0, ceiling=60.0), ladder=8.0), window, full(100))
    assert state.heavy
    stale = OutcomeWindow(accepted=35 + 15, refused=65, accepted_fresh=15)
    state, plan = run(state, stale, full(plan.budget))
    assert not state.regrow


def test_a_late_loop_that_released_less_than_the_rate_does_not_grow() -> None:
    # the previous tick ran 4 s ago: the budget covered 2 s (missed ticks are
    # skipped), so 200 jobs left in 4 s at a rate of 100/s
    state = at_ceiling(rate=100.0, ceiling=90.0)
    late, _ = run(state, OutcomeWindow(accepted=200, accepted_fresh=200), full(200), dt=4.0)
    assert late.rate == 100.0
    on_time, _ = run(state, OutcomeWindow(accepted=100, accepted_fresh=100), full(100))
    assert on_time.rate > 100.0
    slow_start = replace(initial_state(P, now=T0), rate=100.0)
    late, _ = run(slow_start, OutcomeWindow(accepted=200, accepted_fresh=200), full(200), dt=4.0)
    assert late.rate == 100.0


def test_no_growth_while_work_piles_up_in_flight() -> None:
    state = at_ceiling(rate=100.0, ceiling=90.0)
    window = OutcomeWindow(accepted=100, accepted_fresh=100)
    piled, _ = run(state, window, full(100), inflight=500)  # 5 s of the rate in flight
    assert piled.rate == 100.0
    flowing, _ = run(state, window, full(100), inflight=150)
    assert flowing.rate > 100.0


def test_past_slow_start_no_growth_while_outcomes_come_back_at_under_half_the_rate() -> None:
    # a ladder over a stale ceiling: released at 300/s, in flight under the
    # bound, nothing refused, but only 100 outcomes a second come back: the
    # rest waits before workers slower than the rate
    state = replace(at_ceiling(rate=300.0, ceiling=90.0), ladder=60.0)
    slow = OutcomeWindow(accepted=100, accepted_fresh=100)
    held, _ = run(state, slow, full(300), inflight=200)
    assert held.rate == 300.0
    keeping_up = OutcomeWindow(accepted=250, accepted_fresh=250)  # a ladder a step behind
    grown, _ = run(state, keeping_up, full(300), inflight=200)
    assert grown.rate > 300.0


@pytest.mark.parametrize("inflight", [0, 500])
def test_a_reload_that_raises_min_rate_takes_effect_on_every_path(inflight: int) -> None:
    # whether the tick may grow or not (work piled up in flight), the new bounds hold
    raised = replace(P, min_rate=500.0, initial_rate=500.0, max_rate=1000.0)
    state = at_ceiling(rate=100.0, ceiling=90.0)
    after, plan = run(state, OutcomeWindow(accepted=100, accepted_fresh=100), full(100),
                      inflight=inflight, params=raised)  # fmt: skip
    assert after.rate >= 500.0
    assert plan.budget > 0


def test_a_ladder_never_adds_more_than_its_cap_in_one_tick() -> None:
    state = replace(at_ceiling(rate=100.0, ceiling=60.0), ladder=80.0)
    state, _ = run(state, OutcomeWindow(accepted=100, accepted_fresh=100), full(100), dt=2.0)
    assert state.rate <= 100.0 * (1 + pacer.LADDER_MAX) + 1e-9


def test_retry_after_closes_then_resumes_just_under_the_ceiling_and_holds() -> None:
    state = replace(at_ceiling(rate=100.0), delivered=80.0)
    window = OutcomeWindow(accepted=60, refused=20, refused_fresh=20, retry_after_s=10.0)
    state, plan = run(state, window, full(100), cooldown=10.0)
    assert (plan.budget, plan.cooldown, state.rate) == (0, True, 100.0)
    assert state.ceiling == pytest.approx(80.0)
    state, plan = run(state, EMPTY, Demand(budget=0), cooldown=5.0)
    assert (plan.budget, state.rate) == (0, 100.0)
    state, plan = run(state, EMPTY, Demand(budget=0))
    assert state.rate == pytest.approx(80.0 * P.ceiling_resume_fraction)
    assert plan.budget > 0
    for _ in range(20):  # probing into a penalty box is rationed
        state, plan = run(state, OutcomeWindow(accepted=72, accepted_fresh=72), full(plan.budget))
    assert state.rate == pytest.approx(80.0 * P.ceiling_resume_fraction)


def test_a_retry_after_of_a_few_round_trips_holds_only_a_few_round_trips() -> None:
    # an API that sends `Retry-After: 1` with every 429 says when the next
    # token comes: no penalty box, so no retry_after / decrease_margin hold
    state = replace(at_ceiling(rate=100.0), delivered=80.0)
    window = OutcomeWindow(accepted=78, refused=2, refused_fresh=2, retry_after_s=1.0)
    state, plan = run(state, window, full(100), cooldown=1.0)
    assert plan.cooldown
    assert state.hold_s == pytest.approx(pacer.SHORT_HOLD_RTTS * P.tick_seconds)
    state, plan = run(state, EMPTY, Demand(budget=0))  # reopened
    resumed = state.rate
    assert resumed == pytest.approx(80.0 * P.ceiling_resume_fraction)
    for _ in range(int(pacer.SHORT_HOLD_RTTS) + 2):
        window = OutcomeWindow(accepted=plan.budget, accepted_fresh=plan.budget)
        state, plan = run(state, window, full(plan.budget))
    assert state.rate > resumed  # growing again after a few round trips


def test_refused_again_in_the_hold_of_a_token_wait_the_ceiling_is_bracketed_by_its_cycle() -> None:
    # `Retry-After: 1` with every 429: the bucket was empty at both, so its
    # refill rate lies between what it let through over the cycle, closure
    # included (95 in 2 s), and the window's rate while open (95/s, which
    # spent tokens stored while it was closed): the geometric mean
    state = replace(at_ceiling(rate=100.0), delivered=100.0)
    first = OutcomeWindow(accepted=90, refused=2, refused_fresh=2, retry_after_s=1.0)
    state, plan = run(state, first, full(100), cooldown=1.0)
    assert (state.cooling, state.token_wait, state.firm) == (True, True, True)
    state, plan = run(state, EMPTY, Demand(budget=0))  # reopened
    assert state.rate == pytest.approx(100.0 * P.ceiling_resume_fraction)
    again = OutcomeWindow(accepted=95, refused=1, accepted_fresh=95, refused_fresh=1,
                          retry_after_s=1.0)  # fmt: skip
    cut, plan = run(state, again, full(plan.budget), cooldown=1.0)
    window_rate = max(state.delivered, 95.0)
    cycle = 95 / (state.since_cut_s + 1.0)  # 95 accepted since the first Retry-After
    assert cut.ceiling is not None
    assert cut.ceiling == pytest.approx(math.sqrt(cycle * window_rate))
    assert cut.ceiling < 0.9 * window_rate
    assert cut.peak >= 90.0  # the rate refused (at least): the capacity fell from it
    state, plan = run(cut, EMPTY, Demand(budget=0))
    assert state.rate == pytest.approx(cut.ceiling * P.ceiling_resume_fraction)
    # past the hold, a Retry-After measures its window again (the rate grew
    # meanwhile, so the refusal says nothing of the reopening)
    for _ in range(int(pacer.SHORT_HOLD_RTTS) + 1):
        window = OutcomeWindow(accepted=plan.budget, accepted_fresh=plan.budget)
        state, plan = run(state, window, full(plan.budget))
    assert state.hold_s == 0.0
    window = replace(again, accepted=40, accepted_fresh=40)
    later, _ = run(state, window, full(plan.budget), cooldown=1.0)
    assert state.ceiling is not None
    assert 40.0 < state.delivered < state.ceiling
    assert later.ceiling == pytest.approx(state.delivered)  # the window's measure


def test_a_token_wait_ending_slow_start_reopens_under_what_its_ramp_had_accepted() -> None:
    # the tick began at 50/s and ramped to 150 jobs in its second: 90 accepted
    state = replace(initial_state(P, now=T0), rate=50.0, delivered=40.0)
    window = OutcomeWindow(accepted=90, refused=1, accepted_fresh=90, refused_fresh=1,
                           retry_after_s=1.0)  # fmt: skip
    state, _ = run(state, window, full(150), cooldown=1.0)
    assert state.ceiling == pytest.approx(90.0)
    state, _ = run(state, EMPTY, Demand(budget=0))  # reopened
    assert state.rate == pytest.approx(90.0 * P.ceiling_resume_fraction)  # not 50 x 0.9


def _token_wait_heard_mid_tick(accepted: int) -> PacerState:
    """Slow start's tick began at 40/s; 0.4 s in, a Retry-After closed the
    destination, 33 jobs sent, then nothing for 0.6 s; the window held
    ``accepted`` outcomes and the one refusal."""
    state = replace(initial_state(P, now=T0), rate=40.0, delivered=30.0)
    window = OutcomeWindow(accepted=accepted, refused=1, accepted_fresh=accepted,
                           refused_fresh=1, retry_after_s=1.0)  # fmt: skip
    closed = Demand(budget=120, admitted=60, open_seconds=0.4, sent=33)
    state, _ = run(state, window, closed, cooldown=1.0)
    return state


def test_a_token_wait_heard_mid_tick_measures_the_upstream_while_it_was_open() -> None:
    state = _token_wait_heard_mid_tick(accepted=32)
    assert state.ceiling == pytest.approx(32 / 0.4)  # not the window's 32/s
    state, _ = run(state, EMPTY, Demand(budget=0))  # reopened
    assert state.rate == pytest.approx(80.0 * P.ceiling_resume_fraction)


def test_the_open_measure_counts_only_what_the_closed_tick_sent() -> None:
    # outcomes of the tick before reached this window too: no more than sent
    state = _token_wait_heard_mid_tick(accepted=45)
    assert state.ceiling == pytest.approx((33 - 1) / 0.4)


def test_a_token_wait_heard_as_a_tick_began_measures_the_tick_before() -> None:
    # the refusal came from the tail of a tick that accepted 70/s; the next
    # tick closed 10 ms after it began, having sent one job
    state = replace(initial_state(P, now=T0), rate=40.0, delivered=30.0)
    ramp = OutcomeWindow(accepted=70, accepted_fresh=70)
    state, _ = run(state, ramp, full(70))
    assert state.window_rate == pytest.approx(70.0)
    window = OutcomeWindow(accepted=2, refused=1, accepted_fresh=2, refused_fresh=1,
                           retry_after_s=1.0)  # fmt: skip
    closed = Demand(budget=200, admitted=2, open_seconds=0.01, sent=1)
    state, _ = run(state, window, closed, cooldown=1.0)
    assert state.ceiling == pytest.approx(70.0)


def test_a_penalty_box_heard_mid_tick_keeps_the_windows_measure() -> None:
    state = replace(at_ceiling(rate=100.0), delivered=100.0)
    box = OutcomeWindow(accepted=40, refused=2, accepted_fresh=40, refused_fresh=2,
                        retry_after_s=10.0)  # fmt: skip
    closed = Demand(budget=100, admitted=100, open_seconds=0.4, sent=42)
    state, _ = run(state, box, closed, cooldown=10.0)
    assert state.ceiling == pytest.approx(100.0)  # the delivered rate, not 40 / 0.4


@pytest.mark.parametrize(("token_wait", "probes"), [(True, True), (False, False)])
def test_a_token_waits_firm_ceiling_is_probed_soon(token_wait: bool, probes: bool) -> None:
    state = replace(at_ceiling(rate=100.0, ceiling=100.0), token_wait=token_wait)
    for _ in range(int(pacer.PEAK_PROBE_RTTS) + 1):
        window = OutcomeWindow(accepted=100, accepted_fresh=100)
        state, _ = run(state, window, full(100))
    assert (state.ladder > 0) is probes


def test_a_penalty_boxs_retry_after_is_not_measured_over_its_cycle() -> None:
    state = replace(at_ceiling(rate=100.0), delivered=100.0)
    box = OutcomeWindow(accepted=90, refused=2, refused_fresh=2, retry_after_s=10.0)
    state, plan = run(state, box, full(100), cooldown=10.0)
    assert (state.token_wait, state.firm) == (False, False)
    state, plan = run(state, EMPTY, Demand(budget=0))  # reopened
    again = replace(box, accepted=95, accepted_fresh=95, refused=1, refused_fresh=1)
    cut, _ = run(state, again, full(plan.budget), cooldown=10.0)
    assert cut.ceiling == pytest.approx(max(state.delivered, 95.0))  # the window's measure


# --- persistence --------------------------------------------------------------


def test_state_round_trips_through_json_without_monotonic_times() -> None:
    window = OutcomeWindow(accepted=95, refused=5, accepted_fresh=95, refused_fresh=5)
    state, _ = run(at_ceiling(rate=100.0), window, full(100))
    d = json.loads(json.dumps(state.to_dict()))
    assert "last_tick" not in d
    assert "deadline" not in d
    back = PacerState.from_dict(d, now=5.0, params=P)
    assert replace(back, firm=state.firm, last_tick=state.last_tick, deadline=state.deadline) == (
        state
    )
    assert (back.last_tick, back.deadline, back.firm) == (5.0 - P.tick_seconds, 5.0, False)


def test_a_new_leader_resumes_at_the_persisted_rate() -> None:
    state = at_ceiling(rate=42.0, ceiling=45.0)
    resumed = PacerState.from_dict(state.to_dict(), now=77_000.0, params=P)
    _, plan = plan_tick(resumed, EMPTY, None, now=77_000.0, inflight=0, params=P)
    assert plan.budget == 42


@pytest.mark.parametrize(
    ("d", "error"),
    [
        ({}, ValueError),
        ({"rate": "fast"}, TypeError),
        ({"rate": -1.0}, ValueError),
        ({"rate": 5.0, "cooling": "yes"}, TypeError),
        ({"rate": 5.0, "ceiling": math.inf}, TypeError),
        ({"rate": True}, TypeError),
    ],
)
def test_a_malformed_state_is_rejected(d: dict[str, object], error: type[Exception]) -> None:
    with pytest.raises(error):
        PacerState.from_dict(d, now=0.0)


def test_importing_the_pacer_loads_no_async_or_driver_module() -> None:
    code = (
        "import sys, pacerd.pacer\n"
        "bad = {'asyncio', 'anyio', 'asyncpg', 'aio_pika'} & set(sys.modules)\n"
        "print(','.join(sorted(bad)))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.strip() == ""


# --- properties ---------------------------------------------------------------

PARAMS = st.builds(
    PacingParams,
    tick_seconds=st.sampled_from([0.25, 1.0, 5.0]),
    initial_rate=st.floats(1.0, 200.0),
    min_rate=st.just(1.0),
    max_rate=st.floats(200.0, 5000.0),
    increase_step=st.floats(0.1, 5.0),
    decrease_factor=st.floats(0.1, 0.9),
    decrease_margin=st.floats(0.0, 0.2),
    refusal_threshold=st.floats(0.0, 0.2),
    max_inflight=st.integers(1, 3000),
    live_share=st.floats(0.0, 1.0),
    slow_start_factor=st.floats(1.0, 3.0),
    refusal_min_count=st.integers(1, 5),
    ceiling_resume_fraction=st.floats(0.5, 1.0),
)


@st.composite
def windows(draw: st.DrawFn) -> OutcomeWindow:
    accepted_fresh = draw(st.integers(0, 300))
    refused_fresh = draw(st.integers(0, 300))
    return OutcomeWindow(
        accepted=accepted_fresh + draw(st.integers(0, 300)),
        refused=refused_fresh + draw(st.integers(0, 300)),
        accepted_fresh=accepted_fresh,
        refused_fresh=refused_fresh,
        retry_after_s=draw(st.none() | st.floats(0.1, 60.0)),
        interval_seconds=draw(st.none() | st.floats(0.0, 10.0)),
    )


@st.composite
def demands(draw: st.DrawFn) -> Demand | None:
    if draw(st.booleans()):
        return None
    budget = draw(st.integers(0, 3000))
    return Demand(
        budget=budget,
        admitted=draw(st.integers(0, budget)),
        backlog_empty=draw(st.booleans()),
        inflight_capped=draw(st.booleans()),
    )


STEP = st.tuples(
    windows(),
    demands(),
    st.floats(0.0, 12.0),  # seconds since the previous tick
    st.integers(0, 4000),  # in flight
    st.sampled_from([0.0, 0.0, 0.0, 3.0]),  # Retry-After cool-down left
    st.booleans() | st.just(False),  # paused
)
Step = tuple[OutcomeWindow, Demand | None, float, int, float, bool]


def walk(params: PacingParams, steps: list[Step]) -> list[tuple[PacerState, PacerState, TickPlan]]:
    """(before, after, plan) for each step of a random history."""
    state = initial_state(params, now=T0)
    out = []
    for window, demand, gap, inflight, cooldown, paused in steps:
        after, plan = plan_tick(
            state,
            window,
            demand,
            now=state.last_tick + gap,
            inflight=inflight,
            params=params,
            cooldown_remaining_s=cooldown,
            paused=paused,
        )
        out.append((state, after, plan))
        state = after
    return out


@settings(max_examples=200, deadline=None)
@given(PARAMS, st.lists(STEP, min_size=1, max_size=40))
def test_invariants_hold_over_any_history(params: PacingParams, steps: list[Step]) -> None:
    for (_, after, plan), (_, _, _, inflight, cooldown, paused) in zip(
        walk(params, steps), steps, strict=True
    ):
        assert params.min_rate <= after.rate <= params.max_rate
        assert 0 <= plan.budget <= max(0, params.max_inflight - inflight)
        assert 0.0 <= after.credit < 1.0
        assert 0 <= plan.live_budget <= plan.budget
        if cooldown > 0 or paused:
            assert plan.budget == 0


# Two windows a search found: slow start (factor 1, a late tick paying for
# two) ended or reopened from a Retry-After above the rate the same window
# without refusals kept.
_LATE = PacingParams(
    tick_seconds=0.25, initial_rate=1.0, min_rate=1.0, max_rate=200.0, increase_step=1.0,
    decrease_factor=0.5, decrease_margin=0.0, refusal_threshold=0.0, max_inflight=1,
    live_share=0.0, slow_start_factor=1.0, refusal_min_count=1, ceiling_resume_fraction=1.0,
)  # fmt: skip


@settings(max_examples=200, deadline=None)
@given(
    PARAMS,
    st.lists(STEP, max_size=30),
    STEP,
    st.integers(1, 200),
    st.integers(0, 200),
)
@example(
    _LATE, [], (OutcomeWindow(accepted=5, accepted_fresh=5), full(1), 1.0, 0, 0.0, False), 4, 0
)
@example(
    replace(_LATE, slow_start_factor=2.0), [],
    (OutcomeWindow(accepted=1, retry_after_s=1.0), Demand(budget=2, admitted=1), 1.0, 0, 0.0,
     False),
    1, 0,
)  # fmt: skip
def test_refusals_never_raise_the_rate(
    params: PacingParams, history: list[Step], step: Step, fresh: int, stale: int
) -> None:
    """The same tick with more refusals in its window never ends with a higher rate."""
    state = walk(params, history)[-1][1] if history else initial_state(params, now=T0)
    window, demand, gap, inflight, cooldown, paused = step
    worse = replace(
        window, refused=window.refused + fresh + stale, refused_fresh=window.refused_fresh + fresh
    )
    rates = [
        plan_tick(
            state,
            w,
            demand,
            now=state.last_tick + gap,
            inflight=inflight,
            params=params,
            cooldown_remaining_s=cooldown,
            paused=paused,
        )[0].rate
        for w in (window, worse)
    ]
    assert rates[1] <= rates[0] + 1e-9


@settings(max_examples=200, deadline=None)
@given(PARAMS, st.lists(STEP, max_size=30), windows(), st.floats(0.0, 12.0), st.booleans())
def test_an_idle_destination_never_grows(
    params: PacingParams, history: list[Step], window: OutcomeWindow, gap: float, dry: bool
) -> None:
    """No demand (nothing due, or a leader's first tick): the rate does not rise.
    (The refinement of a heavy cut by its own round trip's outcomes is part of
    that cut, not growth.)"""
    state = walk(params, history)[-1][1] if history else initial_state(params, now=T0)
    if state.episode and state.heavy:
        return
    clean = replace(window, refused=0, refused_fresh=0, retry_after_s=None)
    idle = Demand(budget=10, admitted=0, backlog_empty=True) if dry else None
    after, _ = plan_tick(state, clean, idle, now=state.last_tick + gap, inflight=0, params=params)
    assert after.rate <= state.rate + 1e-9


@settings(max_examples=200, deadline=None)
@given(PARAMS, st.lists(st.tuples(st.floats(0.0, 12.0), st.booleans()), min_size=1, max_size=60))
def test_admissions_over_any_window_are_bounded_by_rate_times_window(
    params: PacingParams, ticks: list[tuple[float, bool]]
) -> None:
    """For ticks i..j: sum of budgets <= (highest rate used) x (t_j - t_{i-1}) + 1,
    where t_{i-1} is the previous tick (the first tick looks back one tick) and
    a slow-start tick uses the rate it ramps up to."""
    state = initial_state(params, now=T0)
    times, budgets, rates = [state.last_tick], [], []
    demand: Demand | None = None
    for gap, accepted in ticks:
        now = state.last_tick + gap
        window = OutcomeWindow(accepted=int(state.rate), accepted_fresh=int(state.rate))
        state, plan = plan_tick(
            state, window if accepted else EMPTY, demand, now=now, inflight=0, params=params
        )
        times.append(now)
        budgets.append(plan.budget)
        rates.append(plan.rate * plan.ramp)
        demand = full(plan.budget)
    for i in range(len(budgets)):
        for j in range(i, len(budgets)):
            bound = max(rates[i : j + 1]) * (times[j + 1] - times[i]) + 1.0
            assert sum(budgets[i : j + 1]) <= bound + 1e-6


def test_the_module_constants_are_documented_in_the_docstring() -> None:
    doc = pacer.__doc__ or ""
    for name in ("HEAVY_RATIO", "decrease_margin", "increase_step", "slow_start_factor"):
        assert name in doc


@pytest.mark.parametrize(
    ("now", "deadline", "first_end"),
    [
        (10.0, 10.0, 11.0),  # on a schedule point: a whole tick
        (10.3, 10.0, 11.0),  # 0.7 of a tick left: this point
        (10.5, 10.0, 11.0),  # half a tick left: still this point
        (10.9, 11.0, 12.0),  # 0.1 of a tick left: the next one (1.1 ticks)
        (7.95, 8.0, 9.0),
    ],
)
def test_a_destination_joins_the_schedule_with_at_least_half_a_tick(
    now: float, deadline: float, first_end: float
) -> None:
    carried = pacer.join_schedule(2.0, now, 1.0)
    assert carried == pytest.approx(deadline)
    assert pacer.next_deadline(carried, now, 1.0) == pytest.approx(first_end)


def _clean_ticks_until_probe(state: PacerState, ticks: int) -> tuple[PacerState, list[float]]:
    """``ticks`` clean, full-demand ticks at the rate: the rate's step each tick."""
    steps = []
    for _ in range(ticks):
        before = state.rate
        window = OutcomeWindow(accepted=round(before), accepted_fresh=round(before))
        state, _ = run(state, window, full(round(before)))
        steps.append(state.rate - before)
    return state, steps


def test_well_under_the_rate_of_a_recent_heavy_cut_the_ladder_probes_sooner_and_wider() -> None:
    # the capacity fell from 100/s to 30/s: a heavy cut remembers the rate it fell from
    window = OutcomeWindow(accepted=30, refused=70, accepted_fresh=30, refused_fresh=70)
    cut, _ = run(at_ceiling(rate=100.0), window, full(100))
    assert cut.heavy
    assert cut.peak == pytest.approx(100.0)
    # settled at a firm ceiling of 30/s (as the refinement and a mild cut leave it)
    settled = replace(cut, rate=30.0, ceiling=30.0, firm=True, heavy=False, episode=False)
    ticks = int(pacer.PEAK_PROBE_RTTS) + 4
    after_drop, steps = _clean_ticks_until_probe(settled, ticks)
    # far under the peak, the capacity may come back at any time: the probe
    # starts after PEAK_PROBE_RTTS clean round trips, not PROBE_RTTS ...
    assert after_drop.ladder > 0
    assert int(pacer.PEAK_PROBE_RTTS) < int(pacer.PROBE_RTTS)
    # ... and its steps may reach PEAK_LADDER_MAX of the rate (LADDER_MAX elsewhere)
    long_ladder = replace(after_drop, ladder=100.0)
    stepped, _ = _clean_ticks_until_probe(long_ladder, 1)
    assert stepped.rate == pytest.approx(long_ladder.rate * (1 + pacer.PEAK_LADDER_MAX))
    # the same ceiling with no drop behind it waits PROBE_RTTS, in LADDER_MAX steps
    plain, plain_steps = _clean_ticks_until_probe(replace(settled, peak=0.0), ticks)
    assert plain.ladder == 0.0
    assert plain_steps == pytest.approx([P.increase_step] * ticks)
    plain_ladder, _ = _clean_ticks_until_probe(replace(plain, ladder=100.0), 1)
    assert plain_ladder.rate == pytest.approx(plain.rate * (1 + pacer.LADDER_MAX))
    assert steps[: int(pacer.PEAK_PROBE_RTTS) - 1] == pytest.approx(
        [P.increase_step] * (int(pacer.PEAK_PROBE_RTTS) - 1)
    )


def test_the_peak_of_a_drop_fades_and_survives_a_leader_change() -> None:
    window = OutcomeWindow(accepted=30, refused=70, accepted_fresh=30, refused_fresh=70)
    cut, _ = run(at_ceiling(rate=100.0), window, full(100))
    resumed = PacerState.from_dict(json.loads(json.dumps(cut.to_dict())), now=T0, params=P)
    assert resumed.peak == pytest.approx(100.0)
    # PEAK_S later the peak is down to 1/e of itself: an old drop says little
    later, _ = run(resumed, EMPTY, Demand(budget=0), dt=pacer.PEAK_S)
    assert later.peak == pytest.approx(100.0 / math.e, rel=1e-6)
    # a mild cut (a probe's) keeps the peak, only faded by its tick
    mild = OutcomeWindow(accepted=97, refused=3, accepted_fresh=97, refused_fresh=3)
    probed, _ = run(replace(at_ceiling(rate=100.0), peak=80.0), mild, full(100))
    assert probed.epoch == 8
    assert not probed.heavy
    assert probed.peak == pytest.approx(80.0 * math.exp(-1.0 / pacer.PEAK_S))


# -- reopening: a tick run early because the destination opened since the last one


def test_a_reopening_pays_for_what_is_left_of_its_tick_and_the_next_tick_for_a_whole_one() -> None:
    params = PacingParams(tick_seconds=1.0, initial_rate=40.0, max_rate=40.0)
    state, plan = plan_tick(
        initial_state(params, now=T0), EMPTY, None, now=T0, inflight=0, params=params, paused=True
    )
    assert plan.budget == 0
    assert plan.next_deadline == pytest.approx(T0 + 1.0)
    # resumed 0.3 s into the tick: released from then on, until the schedule's next point
    state, plan = plan_tick(
        state, EMPTY, Demand(), now=T0 + 0.3, inflight=0, params=params, reopening=True
    )
    assert plan.next_deadline == pytest.approx(T0 + 1.0)
    assert plan.budget == 28  # 40/s over the 0.7 s left
    assert plan.spacing_seconds == pytest.approx(0.7 / 28)
    budgets = []
    for k in (1, 2):
        state, plan = plan_tick(
            state, EMPTY, full(plan.budget), now=T0 + k, inflight=0, params=params
        )
        budgets.append(plan.budget)
        assert plan.next_deadline == pytest.approx(T0 + k + 1)
    assert budgets == [40, 40]  # not 28: the reopening paid for the 0.7 s before it


def test_a_reopening_that_finds_it_still_closed_admits_nothing_and_keeps_the_schedule() -> None:
    params = PacingParams(tick_seconds=1.0, initial_rate=40.0, max_rate=40.0)
    state, _ = plan_tick(
        initial_state(params, now=T0), EMPTY, None, now=T0, inflight=0, params=params, paused=True
    )
    state, plan = plan_tick(
        state, EMPTY, Demand(), now=T0 + 0.6, inflight=0, params=params,
        cooldown_remaining_s=0.01, reopening=True,
    )  # fmt: skip
    assert plan.budget == 0
    assert plan.next_deadline == pytest.approx(T0 + 1.0)
    state, plan = plan_tick(state, EMPTY, Demand(), now=T0 + 1.0, inflight=0, params=params)
    assert plan.budget == math.floor(state.rate)  # a whole tick, at the rate it reopens with


def test_a_reopening_at_its_deadline_is_an_ordinary_tick() -> None:
    params = PacingParams(tick_seconds=1.0, initial_rate=40.0, max_rate=40.0)
    state, _ = plan_tick(
        initial_state(params, now=T0), EMPTY, None, now=T0, inflight=0, params=params, paused=True
    )
    for reopening in (False, True):
        after, plan = plan_tick(
            state, EMPTY, Demand(), now=T0 + 1.02, inflight=0, params=params, reopening=reopening
        )
        assert plan.budget == 40
        assert plan.next_deadline == pytest.approx(T0 + 2.0)
        assert not after.prepaid


@settings(max_examples=200, deadline=None)
@given(
    PARAMS,
    st.lists(st.tuples(st.floats(0.0, 1.0), st.booleans(), st.booleans()), min_size=1, max_size=60),
)
def test_reopenings_never_release_faster_than_the_rate(
    params: PacingParams, ticks: list[tuple[float, bool, bool]]
) -> None:
    """Each tick releases its budget between its start and its deadline; with
    reopenings anywhere in a history of closed and open ticks, the budgets of
    ticks i..j stay within CATCH_UP x (highest rate) x (deadline_j - start_i) + 1."""
    state = initial_state(params, now=T0)
    starts: list[float] = []
    ends: list[float] = []
    budgets: list[int] = []
    rates: list[float] = []
    now, closed = T0, False
    for position, reopen, close in ticks:
        early = reopen and closed  # woken before the deadline, after a closed tick
        now = (now + position * (state.deadline - now)) if early else max(now, state.deadline)
        state, plan = plan_tick(
            state, EMPTY, full(budgets[-1]) if budgets else None, now=now, inflight=0,
            params=params, paused=close, reopening=early,
        )  # fmt: skip
        starts.append(now)
        ends.append(plan.next_deadline)
        budgets.append(plan.budget)
        rates.append(state.rate)
        closed = close
    for i in range(len(budgets)):
        for j in range(i, len(budgets)):
            bound = CATCH_UP * max(rates[i : j + 1]) * (ends[j] - starts[i]) + 1.0
            assert sum(budgets[i : j + 1]) <= bound + 1e-6
