"""What a demo run is made of: its destinations, each with the capacity
schedule of its model upstream, its backlog and its live trickle; the daemon's
configuration for the run; and the job ids of the backlog.

Shared by the runner (``runner``), which carries a plan out, and the report
(``report``), which checks and shows its results; it imports neither.
"""

from __future__ import annotations

import itertools
import math
import secrets
from dataclasses import dataclass, field

from pacerd.testing.upstream import CapacitySchedule

DEFAULT_DURATION = 180.0


@dataclass(frozen=True, slots=True, kw_only=True)
class DestinationPlan:
    name: str
    schedule: CapacitySchedule
    retry_after: bool  # an LLM-style API says when to come back; a carrier API does not
    latency_median_ms: float
    error_rate: float
    backlog: int
    trickle_per_second: float


@dataclass(frozen=True, slots=True, kw_only=True)
class DemoPlan:
    duration_seconds: float
    workers: int
    destinations: tuple[DestinationPlan, ...]
    run_id: str = field(default_factory=lambda: secrets.token_hex(3))

    def config_toml(self, dsn: str, amqp_url: str) -> str:
        """Short ticks and leases, so a few minutes show the whole story."""
        return (
            f'[database]\ndsn = "{dsn}"\n\n[broker]\nurl = "{amqp_url}"\n\n'
            "[pacing]\ntick_seconds = 0.5\ninitial_rate = 10.0\nmin_rate = 2.0\n"
            "max_rate = 400.0\nincrease_step = 2.0\nmax_inflight = 400\n"
            "live_share = 0.2\nlive_window_seconds = 30.0\n\n"
            "[leases]\nclaim_seconds = 15.0\noffer_seconds = 30.0\n\n"
            "[retry]\nmax_attempts = 8\nbackoff_base_seconds = 0.5\nbackoff_cap_seconds = 10.0\n\n"
            "[reconcile]\ninterval_seconds = 2.0\n\n[daemon]\nshutdown_grace_seconds = 5.0\n\n"
            '[telemetry]\nservice_name = "pacerd-demo"\nlog_format = "json"\n'
        )


def make_plan(
    *,
    duration_seconds: float = DEFAULT_DURATION,
    workers: int = 3,
    jobs: int | None = None,
    prefix: str = "demo",
) -> DemoPlan:
    """Two destinations, ``jobs`` overdue in all, split in halves; by default
    each destination's backlog is what its upstream accepts at capacity over
    the whole run (live jobs come on top), so the capacity steps, the step ups
    included, all fall while there is backlog to send."""
    d = duration_seconds
    llm = CapacitySchedule(((0.0, 100.0), (0.33 * d, 35.0), (0.67 * d, 90.0)))
    carrier = CapacitySchedule(
        ((0.0, 60.0), (0.3 * d, 110.0), (0.55 * d, 40.0), (0.8 * d, 80.0)), ramp=True
    )
    if jobs is None:
        backlogs = [math.ceil(capacity_calls(s, 0.0, d)) for s in (llm, carrier)]
    else:
        backlogs = [jobs // 2, jobs - jobs // 2]
    return DemoPlan(
        duration_seconds=d,
        workers=workers,
        destinations=(
            DestinationPlan(
                name=f"{prefix}-llm",
                schedule=llm,
                retry_after=True,
                latency_median_ms=150.0,
                error_rate=0.0,
                backlog=backlogs[0],
                trickle_per_second=4.0,
            ),
            DestinationPlan(
                name=f"{prefix}-carrier",
                schedule=carrier,
                retry_after=False,
                latency_median_ms=80.0,
                error_rate=0.01,
                backlog=backlogs[1],
                trickle_per_second=4.0,
            ),
        ),
    )


def capacity_calls(schedule: CapacitySchedule, start: float, end: float) -> float:
    """The calls ``schedule`` lets through from ``start`` to ``end`` (seconds
    after the upstream started) at capacity: its integral, exact for steps and
    ramps (the upstream's token bucket refills at this rate)."""
    if end <= start:
        return 0.0
    cuts = sorted({start, end, *(t for t, _ in schedule.points if start < t < end)})
    total = 0.0
    for a, b in itertools.pairwise(cuts):
        if schedule.ramp:  # linear between the points: the trapezoid is exact
            total += (schedule.rate_at(a) + schedule.rate_at(b)) / 2 * (b - a)
        else:  # constant from a point up to the next
            total += schedule.rate_at(a) * (b - a)
    return total


def backlog_prefix(plan: DemoPlan, destination: str) -> str:
    return f"{plan.run_id}-backlog-{destination}-"
