"""The demo's figures on synthetic per-second samples: utilization counts only
the seconds when the run's backlog (not the live trickle) was due at both ends
of the second, from the first call on; the time to 90 % after a capacity step
up is measured only while backlog remains, and is never made up when it ran
out or the run ended first."""

from __future__ import annotations

import pytest

from pacerd.testing.upstream import CapacitySchedule
from pacerd_demo.plan import capacity_calls, make_plan
from pacerd_demo.report import (
    DestinationSummary,
    Sample,
    StepUpRecovery,
    backlog_seconds,
    headline,
    startup_seconds,
    step_up_recoveries,
    step_ups_text,
    utilization,
)

FLAT = CapacitySchedule(((0.0, 100.0),))


def sample(second: int, accepted: int, backlog_due: int, *, due: int | None = None) -> Sample:
    return Sample(
        t=second + 1.0, second=second, destination="d", capacity=100.0, accepted=accepted,
        refused=0, errors=0, rate=100.0, due=backlog_due + 3 if due is None else due,
        backlog_due=backlog_due, inflight=0, oldest_due_age_seconds=None,
        drain_eta_seconds=None, completed=0, dead=0,
    )  # fmt: skip


def test_a_live_trickle_alone_counts_no_second() -> None:
    # the backlog is gone; live jobs keep "due" above zero, 4 a second are sent
    history = [sample(k, accepted=4, backlog_due=0, due=2) for k in range(10)]
    assert all(s.due > 0 for s in history)
    assert backlog_seconds(history) == []
    assert utilization(FLAT, history) is None


def test_only_the_seconds_with_backlog_count_not_the_live_tail() -> None:
    backlog = [sample(k, accepted=95, backlog_due=500 - 95 * k) for k in range(5)]
    tail = [sample(k, accepted=4, backlog_due=0, due=3) for k in range(5, 20)]
    history = backlog + tail
    assert [s.second for s in backlog_seconds(history)] == [0, 1, 2, 3, 4]
    assert utilization(FLAT, history) == pytest.approx(0.95)
    # the old measure (every second with due > 0) would have said 27 %
    assert sum(s.accepted for s in history) / (100.0 * len(history)) == pytest.approx(0.2675)


def test_a_second_in_which_the_backlog_ran_out_does_not_count() -> None:
    history = [
        sample(0, accepted=100, backlog_due=120),
        sample(1, accepted=60, backlog_due=0),  # due at its start, gone by its end
        sample(2, accepted=30, backlog_due=5),  # a retry came due: not at its start
        sample(3, accepted=90, backlog_due=4),  # due at both ends
    ]
    assert [s.second for s in backlog_seconds(history)] == [0, 3]
    assert utilization(FLAT, history) == pytest.approx(190 / 200)


def test_start_up_before_the_first_call_is_not_counted_but_reported() -> None:
    history = [sample(k, accepted=0, backlog_due=1000) for k in range(2)]
    history += [sample(k, accepted=80, backlog_due=1000 - 80 * k) for k in range(2, 6)]
    assert startup_seconds(history) == 3.0
    assert [s.second for s in backlog_seconds(history)] == [2, 3, 4, 5]
    assert utilization(FLAT, history) == pytest.approx(0.8)
    assert startup_seconds(history[:2]) is None


def test_capacity_is_the_schedules_integral_over_each_second() -> None:
    step = CapacitySchedule(((0.0, 100.0), (2.5, 40.0)))
    assert capacity_calls(step, 2.0, 3.0) == pytest.approx(70.0)
    assert capacity_calls(step, 0.0, 10.0) == pytest.approx(250 + 300)
    ramp = CapacitySchedule(((0.0, 60.0), (10.0, 110.0), (20.0, 40.0)), ramp=True)
    assert capacity_calls(ramp, 0.0, 10.0) == pytest.approx(850.0)
    assert capacity_calls(ramp, 10.0, 30.0) == pytest.approx(750.0 + 400.0)
    history = [sample(2, accepted=63, backlog_due=50), sample(3, accepted=40, backlog_due=50)]
    assert utilization(step, history) == pytest.approx(103 / 110)


def test_the_default_backlog_is_the_run_at_capacity() -> None:
    for duration in (20.0, 180.0):
        plan = make_plan(duration_seconds=duration)
        for d in plan.destinations:
            assert d.backlog == pytest.approx(capacity_calls(d.schedule, 0.0, duration), abs=1)
    assert [d.backlog for d in make_plan(duration_seconds=20.0, jobs=1200).destinations] == [
        600,
        600,
    ]


STEP_UP = CapacitySchedule(((0.0, 100.0), (5.0, 40.0), (10.0, 90.0)))


def test_the_time_to_90_percent_after_a_step_up_while_backlog_remains() -> None:
    accepted = [100] * 5 + [40] * 5 + [50, 70, 85, 90, 90]
    history = [sample(k, accepted=a, backlog_due=2000) for k, a in enumerate(accepted)]
    (up,) = step_up_recoveries(STEP_UP, history)
    assert (up.at, up.capacity, up.seconds, up.ended_by) == (10.0, 90.0, 3.0, "caught up")
    assert up.text() == "3.0 s"


def test_no_figure_is_made_up_when_the_backlog_ran_out_first() -> None:
    accepted = [100] * 5 + [40] * 5 + [50, 60, 70, 90]
    backlog = [2000] * 12 + [0, 0]  # gone in second 12, before the good second 13
    history = [
        sample(k, accepted=a, backlog_due=b)
        for k, a, b in zip(range(14), accepted, backlog, strict=True)
    ]
    (up,) = step_up_recoveries(STEP_UP, history)
    assert (up.seconds, up.ended_by, up.watched) == (None, "backlog ran out", 2.0)
    assert up.text() == "n/a (backlog ran out after 2.0 s)"
    gone = [sample(k, accepted=a, backlog_due=0 if k >= 9 else 900) for k, a in enumerate(accepted)]
    (up,) = step_up_recoveries(STEP_UP, gone)
    assert up.seconds is None
    assert up.text() == "n/a (backlog ran out)"


def test_a_run_that_ends_first_says_how_long_it_watched() -> None:
    accepted = [100] * 5 + [40] * 5 + [50, 60, 70]
    history = [sample(k, accepted=a, backlog_due=2000) for k, a in enumerate(accepted)]
    (up,) = step_up_recoveries(STEP_UP, history)
    assert (up.seconds, up.ended_by, up.watched) == (None, "run ended", 3.0)
    assert up.text() == "> 3.0 s (run ended)"
    assert step_up_recoveries(STEP_UP, history[:8]) == ()  # the step up is after the run


def test_a_ramp_is_caught_up_against_each_seconds_capacity() -> None:
    # reaches 80 at 8 s and holds it; the second [7, 8) still ramps (75 calls)
    ramp = CapacitySchedule(((0.0, 110.0), (4.0, 40.0), (8.0, 80.0)), ramp=True)
    history = [sample(k, accepted=70, backlog_due=900) for k in range(8)]
    history += [sample(8, accepted=71, backlog_due=900), sample(9, accepted=72, backlog_due=900)]
    (up,) = step_up_recoveries(ramp, history)
    assert (up.at, up.capacity, up.seconds) == (8.0, 80.0, 2.0)


def test_a_ramps_peak_is_no_step_up() -> None:
    # 110 at 6 s, then falling 14 a second: the capacity would come down to
    # meet any rate, so there is no new level to catch up with
    ramp = CapacitySchedule(((0.0, 60.0), (6.0, 110.0), (11.0, 40.0), (16.0, 80.0)), ramp=True)
    history = [sample(k, accepted=60, backlog_due=900) for k in range(20)]
    assert [u.at for u in step_up_recoveries(ramp, history)] == [16.0]


def test_the_summary_line_names_each_step_up() -> None:
    d = DestinationSummary(
        destination="d", utilization=0.93, backlog_seconds=17, startup_seconds=2.0,
        accepted=900, refused=9, errors=0, completed=900, due_left=80, dead=0, duplicates=0,
        step_ups=(
            StepUpRecovery(at=6.0, capacity=110.0, seconds=3.0, watched=3.0, ended_by="caught up"),
            StepUpRecovery(at=16.0, capacity=80.0, seconds=None, watched=4.0, ended_by="run ended"),
        ),
    )  # fmt: skip
    assert step_ups_text(d) == "@6 s: 3.0 s · @16 s: > 4.0 s (run ended)"
    assert headline(d).startswith("utilization 93% while backlog due · refused 1.0%")
