"""The pure helpers of ``bench/fanout.py``: the ideal drain time, the p99 of
Prometheus buckets, the split of leadership and the check for two instances
admitting one destination at once."""

from __future__ import annotations

import math

import pytest

from bench import fanout

EXPOSITION = """\
# HELP pacerd_tick_duration_seconds Duration of one tick of one destination
# TYPE pacerd_tick_duration_seconds histogram
pacerd_tick_duration_seconds_bucket{destination="tenant-00001",le="0.1"} 8.0
pacerd_tick_duration_seconds_bucket{destination="tenant-00001",le="0.25"} 9.0
pacerd_tick_duration_seconds_bucket{destination="tenant-00001",le="+Inf"} 10.0
pacerd_tick_duration_seconds_count{destination="tenant-00001"} 10.0
pacerd_tick_duration_seconds_sum{destination="tenant-00001"} 1.5
pacerd_tick_duration_seconds_bucket{destination="tenant-00002",le="0.1"} 2.0
pacerd_tick_duration_seconds_bucket{destination="tenant-00002",le="0.25"} 4.0
pacerd_tick_duration_seconds_bucket{destination="tenant-00002",le="+Inf"} 4.0
pacerd_tick_duration_seconds_count{destination="tenant-00002"} 4.0
pacerd_tick_duration_seconds_sum{destination="tenant-00002"} 0.5
# HELP pacerd_ledger_statements_total Statements
# TYPE pacerd_ledger_statements_total counter
pacerd_ledger_statements_total{statement="claim_due"} 30.0
pacerd_ledger_statements_total{statement="apply_reports"} 12.0
"""


def test_ideal_drain_time_is_the_jobs_over_the_rate() -> None:
    assert fanout.ideal_drain_seconds(5, 2.0) == 2.5
    assert fanout.drain_target_seconds(5, 2.0, 1.0) == 5.5
    assert fanout.drain_target_seconds(5, 2.0, 0.5, slack_ticks=3) == 4.0
    with pytest.raises(ValueError, match="rate"):
        fanout.ideal_drain_seconds(5, 0.0)


def test_buckets_are_summed_over_every_series() -> None:
    samples = fanout.parse_metrics(EXPOSITION)
    assert fanout.histogram_buckets(samples, fanout.TICK_HISTOGRAM) == {
        0.1: 10.0,
        0.25: 13.0,
        math.inf: 14.0,
    }
    assert fanout.metric_sum(samples, fanout.STATEMENTS_COUNTER) == 42.0
    assert fanout.metric_sum(samples, "pacerd_absent_total") is None
    assert fanout.histogram_buckets(samples, "pacerd_absent_seconds") == {}


def test_statements_are_read_by_name() -> None:
    samples = fanout.parse_metrics(EXPOSITION)
    assert fanout.statements_by_name(samples) == {"claim_due": 30.0, "apply_reports": 12.0}
    assert fanout.OUTCOME_STATEMENTS & set(fanout.statements_by_name(samples)) == {"apply_reports"}


def test_quantile_interpolates_inside_its_bucket_as_prometheus_does() -> None:
    buckets = {0.1: 50.0, 0.25: 90.0, 1.0: 100.0, math.inf: 100.0}
    assert fanout.histogram_quantile(0.5, buckets) == pytest.approx(0.1)
    assert fanout.histogram_quantile(0.25, buckets) == pytest.approx(0.05)  # from 0
    assert fanout.histogram_quantile(0.7, buckets) == pytest.approx(0.175)
    assert fanout.histogram_quantile(0.99, buckets) == pytest.approx(0.25 + 0.75 * 0.9)
    assert fanout.quantile_bucket(0.99, buckets) == 1.0
    assert fanout.quantile_bucket(0.5, buckets) == 0.1


def test_quantile_in_the_inf_bucket_is_the_largest_finite_bound() -> None:
    buckets = {0.1: 10.0, 0.25: 10.0, math.inf: 20.0}
    assert fanout.histogram_quantile(0.99, buckets) == 0.25
    assert fanout.quantile_bucket(0.99, buckets) == math.inf


def test_no_observations_no_quantile() -> None:
    assert fanout.histogram_quantile(0.99, {}) is None
    assert fanout.histogram_quantile(0.99, {0.1: 0.0, math.inf: 0.0}) is None
    assert fanout.quantile_bucket(0.99, {}) is None
    with pytest.raises(ValueError, match="q"):
        fanout.histogram_quantile(1.5, {0.1: 1.0})


def test_a_window_is_the_difference_of_two_readings() -> None:
    before = {0.1: 10.0, math.inf: 12.0}
    after = {0.1: 15.0, 0.25: 3.0, math.inf: 20.0}
    assert fanout.bucket_delta(before, after) == {0.1: 5.0, 0.25: 3.0, math.inf: 8.0}
    assert fanout.per_tick(300, 30.0, 1.0) == 10.0
    assert fanout.per_tick(300, 30.0, 0.5) == 5.0
    assert math.isnan(fanout.per_tick(1, 0.0, 1.0))


def test_active_destinations_are_spread_and_nested() -> None:
    assert fanout.spread_indices(200, 20) == list(range(0, 200, 10))
    small, large = fanout.spread_indices(10_000, 10), fanout.spread_indices(10_000, 1_000)
    assert set(small) <= set(large) <= set(range(10_000))
    assert len(set(fanout.spread_indices(7, 3))) == 3
    with pytest.raises(ValueError, match="cannot pick"):
        fanout.spread_indices(3, 4)
    assert fanout.destination_name(42, fanout.name_width(10_000)) == "tenant-00042"
    assert fanout.name_width(1_000_001) == 7


def test_split_counts_every_instance_and_evenness() -> None:
    leaders = {"p0": "a", "p1": "b", "p2": "a", "p3": None}
    counts = fanout.split_counts(leaders, ["a", "b", "c"])
    assert counts == {"a": 2, "b": 1, "c": 0}
    assert not fanout.is_even(counts)
    assert fanout.is_even({"a": 5, "b": 4})
    assert not fanout.is_even({})


def test_two_instances_within_a_tick_are_caught() -> None:
    claims = [
        ("t1", 10.0, "a"),
        ("t1", 10.0, "a"),  # two claim chunks of one tick
        ("t1", 11.0, "a"),
        ("t1", 12.5, "b"),  # a takeover 1.5 ticks after the last claim: fine
        ("t2", 10.0, "a"),
        ("t2", 10.4, "b"),  # two instances in one tick
        ("t2", 10.9, "a"),
    ]
    assert fanout.two_instance_windows(claims, 1.0) == {"t2": 2}
    assert fanout.two_instance_windows(claims, 2.0) == {"t1": 1, "t2": 2}
    assert fanout.two_instance_windows([], 1.0) == {}


def test_verdicts() -> None:
    assert fanout.verdict(2.0, 2.0) == "PASS"
    assert fanout.verdict(2.1, 2.0) == "FAIL"
    assert fanout.verdict(None, 2.0) == "n/a"
    assert fanout.verdict(math.nan, 2.0) == "n/a"
    assert fanout.percent_of_core(0.3, 30.0) == pytest.approx(1.0)


def test_status_json_split_reads_partitions_or_destinations() -> None:
    destinations = [{"destination": "t1", "leader": "a"}, {"destination": "t2", "leader": None}]
    assert fanout.status_split(destinations) == {"a": 1, "(none)": 1}
    partitions = {"partitions": [{"partition": 0, "leader": "b"}], "destinations": []}
    assert fanout.status_split(partitions) == {"b": 1}
    assert fanout.status_split({"error": "x"}) is None


def test_the_quick_mode_and_the_defaults() -> None:
    quick = fanout.parse_args(["--quick"])
    assert (quick.destinations, quick.active, quick.levels) == (200, 20, [10, 20])
    full = fanout.parse_args(["--only", "drain,idle", "--levels", "1000,10"])
    assert (full.destinations, full.active, full.jobs_per) == (10_000, 1_000, 5)
    assert full.only == ["drain", "idle"]
    assert full.levels == [10, 1000]
    assert (quick.level_jobs, full.level_jobs) == (0.0, 0.0)  # --rate each
    assert fanout.parse_args(["--level-jobs", "2000"]).level_jobs == 2000.0
    with pytest.raises(SystemExit):
        fanout.parse_args(["--level-jobs", "-1"])
    with pytest.raises(SystemExit):
        fanout.parse_args(["--only", "nope"])


def test_every_level_asks_for_the_same_jobs_unless_told_otherwise() -> None:
    rates = {lv: fanout.level_rate(lv, 2000.0, 2.0) for lv in (10, 1000, 10_000)}
    assert rates == {10: 200.0, 1000: 2.0, 10_000: 0.2}
    assert fanout.level_rate(10_000, 0.0, 2.0) == 2.0  # --level-jobs 0: --rate each
    with pytest.raises(ValueError, match="must be > 0"):
        fanout.level_rate(0, 2000.0, 2.0)


def test_live_instances_override_the_ledger_column() -> None:
    ledger = {"t1": "a", "t2": None, "t3": "a"}
    merged = fanout.merge_leaders(ledger, {"b": ["t1", "t2", "#reconciler"]})
    assert merged == {"t1": "b", "t2": "b", "t3": "a"}
    assert fanout.merge_leaders(ledger, {}) == ledger
