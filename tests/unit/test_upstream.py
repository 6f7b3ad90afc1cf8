"""The model upstream's pure logic, deterministically (time passed in, seeded
randomness, no sockets): capacity schedules, the token bucket, Retry-After,
penalty mode, injected errors, latency, idempotency keys and per-second stats."""

from __future__ import annotations

import random
import statistics
from typing import Any

import pytest

from pacerd.testing.upstream import (
    CapacitySchedule,
    UpstreamModel,
    UpstreamParams,
    build_parser,
    params_from_args,
)


def model(schedule: str = "0:10", *, ramp: bool = False, seed: int = 1, **kw: Any) -> UpstreamModel:
    params = UpstreamParams(schedule=CapacitySchedule.parse(schedule, ramp=ramp), **kw)
    return UpstreamModel(params, 1000.0, random.Random(seed))


def test_a_schedule_steps_or_ramps() -> None:
    steps = CapacitySchedule.parse("0:100, 60:30, 120:80")
    assert [steps.rate_at(t) for t in (-5, 0, 59.9, 60, 90, 120, 10_000)] == [
        100, 100, 100, 30, 30, 80, 80,
    ]  # fmt: skip
    ramp = CapacitySchedule.parse("0:100,60:40,120:100", ramp=True)
    assert [ramp.rate_at(t) for t in (0, 30, 60, 90, 120, 500)] == [100, 70, 40, 70, 100, 100]
    assert CapacitySchedule.parse("10:5").rate_at(0) == 5


@pytest.mark.parametrize("bad", ["", "0", "0:x", "0:-1", "10:5,5:6", "0:1,0:2", "nan:1"])
def test_a_bad_schedule_says_why(bad: str) -> None:
    with pytest.raises(ValueError, match="capacity schedule"):
        CapacitySchedule.parse(bad)


def test_the_bucket_admits_capacity_per_second_after_its_burst() -> None:
    m = model("0:10", burst_seconds=1.0)
    statuses = [m.decide(1000.0, f"k{i}").status for i in range(12)]
    assert statuses == [200] * 10 + [429] * 2
    assert m.decide(1000.05, "late").status == 429  # half a token so far
    assert m.decide(1000.1, "k-refilled").status == 200  # one token refilled
    accepted = 0
    for i in range(1, 501):  # 5 s at 100 calls/s, against a capacity of 10/s
        accepted += m.decide(1000.1 + i * 0.01, f"s{i}").status == 200
    assert 49 <= accepted <= 51


def test_retry_after_is_sent_only_when_asked_and_says_when_a_token_is_back() -> None:
    quiet, loud = model("0:0.5"), model("0:0.5", retry_after=True)
    for m in (quiet, loud):
        assert m.decide(1000.0, "a").status == 200
    assert quiet.decide(1000.0, "b").retry_after_s is None
    refused = loud.decide(1000.0, "b")
    assert (refused.status, refused.retry_after_s) == (429, 2)
    assert model("0:0", retry_after=True).decide(1000.0, "x").retry_after_s == 1  # at least 1 s


def test_capacity_follows_the_schedule_and_the_control_override() -> None:
    m = model("0:10,5:2")
    assert m.capacity(1000) == 10
    assert m.capacity(1006) == 2
    m.set_rate(50, 1006)
    assert m.capacity(1006) == 50
    assert m.capacity(2000) == 50
    m.set_rate(None, 1007)
    assert m.capacity(1007) == 2


def test_a_capacity_drop_shrinks_the_bucket() -> None:
    m = model("0:100,1:5")
    assert m.decide(1000.0, "a").status == 200
    accepted = sum(m.decide(1001.0, f"k{i}").status == 200 for i in range(50))
    assert accepted == 5  # the burst is 5 now, not the 99 tokens left


def test_penalty_mode_locks_out_a_hammering_client() -> None:
    m = model("0:10", penalty_seconds=10.0, retry_after=True)
    for i in range(10):
        assert m.decide(1000.0, f"k{i}").status == 200
    assert m.decide(1000.0, "r1").status == 429  # one refusal: tolerated
    second = m.decide(1000.0, "r2")  # more than 10% of capacity refused within a second
    assert second.status == 429
    assert m.penalty_until == 1010.0
    later = m.decide(1005.0, "again")  # the bucket is full again, but the penalty holds
    assert (later.status, later.retry_after_s) == (429, 5)
    assert m.decide(1010.0, "free").status == 200
    assert m.seconds(1010.0)[5].penalty


def test_error_rate_and_latency_are_seeded() -> None:
    m = model("0:100000", error_rate=0.25, latency_median_ms=200.0, latency_sigma=0.5, seed=7)
    decisions = [m.decide(1000.0 + i * 1e-4, f"k{i}") for i in range(4000)]
    errors = sum(d.status == 500 for d in decisions)
    assert 900 <= errors <= 1100
    latency = statistics.median(d.latency_s for d in decisions)
    assert 0.18 <= latency <= 0.22
    again = model("0:100000", error_rate=0.25, latency_median_ms=200.0, seed=7)
    assert [again.decide(1000.0 + i * 1e-4, f"k{i}") for i in range(4000)] == decisions
    assert m.keys.total() == 4000 - errors  # a failed call has no side effect


def test_idempotency_keys_count_duplicate_side_effects() -> None:
    m = model("0:1000")
    assert not m.decide(1000.0, "job-1").duplicate
    assert m.decide(1000.1, "job-1").duplicate
    m.decide(1000.2, "job-2")
    m.decide(1000.3, None)
    assert (m.duplicates, len(m.keys)) == (1, 2)
    assert m.decide(1000.4, "job-1").tokens == m.decide(1000.5, "job-1").tokens


def test_per_second_stats_and_log_lines() -> None:
    m = model("0:2,2:1")
    for t in (0.1, 0.2, 0.3, 2.5, 2.6):
        m.decide(1000 + t, None)
    seconds = m.seconds(1003.5)
    assert [(s.second, s.capacity, s.accepted, s.refused) for s in seconds] == [
        (0, 2, 2, 1), (1, 2, 0, 0), (2, 1, 1, 1), (3, 1, 0, 0),
    ]  # fmt: skip
    assert [s.second for s in m.completed_seconds(1002.5)] == [0, 1]
    assert [s.second for s in m.completed_seconds(1003.5)] == [2]
    snap = m.snapshot(1003.5)
    assert (snap["accepted"], snap["refused"], snap["capacity"]) == (3, 2, 1)
    assert len(snap["seconds"]) == 4


def test_the_command_line_builds_the_params() -> None:
    args = build_parser().parse_args(
        ["--port", "0", "--capacity-schedule", "0:100,60:30", "--ramp", "--retry-after",
         "--penalty-seconds", "10", "--error-rate", "0.01", "--latency-median-ms", "200"]
    )  # fmt: skip
    params = params_from_args(args)
    assert params.schedule.ramp
    assert params.schedule.rate_at(30) == 65
    assert (params.retry_after, params.penalty_seconds, params.error_rate) == (True, 10.0, 0.01)
    assert params.latency_median_ms == 200.0
