"""The release times behind ``pacerd.round_trip_seconds``: each job released
here is timed once, when its outcome is applied, and none is kept past the
offer lease."""

from __future__ import annotations

from pacerd.clock import ManualClock
from pacerd.roundtrips import ReleaseTimes


def test_a_job_released_here_is_timed_once_from_its_release() -> None:
    clock = ManualClock()
    times = ReleaseTimes(clock, horizon_seconds=60.0)
    times.released("mail", "a", 1)
    times.released("mail", "b", 1)
    clock.advance(2.5)
    assert times.heard("a", 1) == ("mail", 2.5)
    assert times.heard("a", 1) is None  # heard once
    assert times.heard("b", 2) is None  # another attempt: not released here
    assert times.heard("c", 1) is None  # released by another instance
    assert len(times) == 1


def test_a_job_released_again_is_timed_from_its_last_release() -> None:
    clock = ManualClock()
    times = ReleaseTimes(clock, horizon_seconds=60.0)
    times.released("mail", "a", 1)
    clock.advance(40.0)
    times.released("mail", "a", 1)  # its publish failed and it went out again
    clock.advance(30.0)  # 70 s after the first release, 30 s after the second
    times.released("sms", "z", 1)  # ages the oldest out: "a" is not among them
    assert times.heard("a", 1) == ("mail", 30.0)


def test_nothing_is_kept_past_the_offer_lease() -> None:
    clock = ManualClock()
    times = ReleaseTimes(clock, horizon_seconds=60.0)
    for i in range(1000):
        times.released("mail", f"j{i}", 1)
    clock.advance(59.0)
    times.released("mail", "late", 1)
    assert len(times) == 1001
    clock.advance(2.0)
    assert times.heard("j0", 1) is None  # 61 s: its report would be stale
    times.released("mail", "later", 1)
    assert len(times) == 2  # the 999 others aged out on the next release
