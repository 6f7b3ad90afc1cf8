"""The scenarios of issue 3, their metrics and their targets.

Metric definitions (all computed from what the model upstream saw, or from the
per-tick records of admission):

- utilization = calls the upstream accepted in a time window / the integral of
  its capacity C(t) over that window (the calls it could have accepted);
  ``util_steady_min`` is the lowest over the phases, each minus its first 60 s;
- refusal % = refused calls / all calls reaching the upstream (every attempt,
  first or retried);
- a tick's *admitted rate* = jobs it claimed and did not give back unsent (a
  mid-tick cut returns the claims it will not send) / tick length; an *overshoot tick*
  admits above the capacity of that moment. ``oscillation_pct`` is
  p95 - p5 of the admitted rate over each phase minus its first 60 s, in % of
  that phase's capacity (the worst phase);
- after the drop (S1): ``drop_overshoot_ticks`` counts overshoot ticks from the
  first tick that sees refusals of calls made after the drop until the first
  tick whose fresh outcomes come back clean (the reaction to the drop);
  ``drop_overshoot_ticks_10s`` (reported, not a target) counts them over 10 s,
  which includes the law's next regular probe; ``drop_recovery_s``: from the
  drop to the first tick, from the one that sees its refusals on, admitting
  >= 90 % of the new capacity; ``rise_recovery_s``: from the rise to the first
  tick admitting >= 90 % of the new capacity;
- S2: Jain index of the two instances' accepted calls over 30 s windows every
  5 s; ``jain_min`` is the worst window starting >= 120 s after the second
  instance; ``fair_after_s`` how long after its start the index stays >= 0.99;
- S3: a dispatch inside an advertised Retry-After window is a publish between
  the moment the refusal carrying it reached the ledger and its end;
- S4: live wait = first publish - due time; live refusals = refused first
  attempts of live-lane jobs / all of them; drain = when the last of the
  40,000 backlog jobs completed / the ideal time at full capacity net of the
  live load;
- S5: the first second by which the upstream accepted >= 90 % of its capacity
  over the previous 5 s;
- S6 (our own targets: the issue names none): the new leader's admitted rate
  over its first 10 s / the old leader's over its last 10 s, utilization over
  the 60 s after the takeover, refusals over the 30 s after the old leader
  stopped, and S1's overall targets.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from simdriver import run
from simlib import InstanceSpec, LedgerSpec, Scenario

from pacerd.pacer import PacingParams

if TYPE_CHECKING:
    from collections.abc import Callable

    from simlib import RunResult

S1_PHASES = ((0.0, 100.0), (300.0, 30.0), (600.0, 80.0))
DEFAULT = PacingParams()


def _params(**kw: float) -> PacingParams:
    return replace(DEFAULT, **kw)  # type: ignore[arg-type]


SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in (
        # capacity 100 -> 30 -> 80 /s, 300 s each, backlog never empties, start at 10/s
        Scenario(name="S1", duration=900.0, phases=S1_PHASES, params=_params(initial_rate=10.0)),
        # the same against a strict upstream: a burst of 0.1 s of capacity
        Scenario(
            name="S1-strict",
            duration=900.0,
            phases=S1_PHASES,
            burst_seconds=0.1,
            params=_params(initial_rate=10.0),
        ),
        # two instances (separate ledgers and pacers) sharing one upstream of 100/s,
        # the second starting 100 s later
        Scenario(
            name="S2",
            duration=400.0,
            phases=((0.0, 100.0),),
            params=_params(initial_rate=10.0),
            ledgers=(LedgerSpec(), LedgerSpec()),
            instances=(
                InstanceSpec(start=0.0, ledger=0, clock_offset=1000.0),
                InstanceSpec(start=100.0, ledger=1, clock_offset=5000.0),
            ),
        ),
        # penalty upstream at 80/s: an overshoot closes it for 10 s (Retry-After)
        Scenario(
            name="S3",
            duration=600.0,
            phases=((0.0, 80.0),),
            penalty_seconds=10.0,
            params=_params(initial_rate=10.0),
        ),
        # 40,000 overdue backlog jobs plus live jobs at 5/s, S1's capacity
        Scenario(
            name="S4",
            duration=900.0,
            phases=S1_PHASES,
            params=_params(initial_rate=10.0),
            ledgers=(LedgerSpec(backlog=40_000, live_rate=5.0),),
        ),
        # cold start from 1/s against 100/s
        Scenario(
            name="S5", duration=120.0, phases=((0.0, 100.0),), params=_params(initial_rate=1.0)
        ),
        # S1 with a leader change: A leads until 450 s, B takes over at 452 s from
        # the persisted state (another host: another monotonic clock)
        Scenario(
            name="S6",
            duration=900.0,
            phases=S1_PHASES,
            params=_params(initial_rate=10.0),
            instances=(
                InstanceSpec(start=0.0, stop=450.0, clock_offset=1000.0),
                InstanceSpec(start=452.0, clock_offset=777_777.0),
            ),
        ),
        # S1 with a 5 s tick
        Scenario(
            name="S7",
            duration=900.0,
            phases=S1_PHASES,
            params=_params(initial_rate=10.0, tick_seconds=5.0),
        ),
    )
}

# ---------------------------------------------------------------------------
# metric helpers


class Calls:
    """Prefix sums over the upstream's calls, for windowed counts."""

    def __init__(self, res: RunResult, *, inst: int | None = None, live: bool = False) -> None:
        self.t: list[float] = []
        self.ok: list[int] = [0]
        self.ref: list[int] = [0]
        for t, i, ok, lv in zip(res.call_t, res.call_inst, res.call_ok, res.call_live, strict=True):
            if (inst is not None and i != inst) or (live and not lv):
                continue
            self.t.append(t)
            self.ok.append(self.ok[-1] + ok)
            self.ref.append(self.ref[-1] + (not ok))

    def counts(self, t0: float, t1: float) -> tuple[int, int]:
        i, j = bisect.bisect_left(self.t, t0), bisect.bisect_left(self.t, t1)
        return self.ok[j] - self.ok[i], self.ref[j] - self.ref[i]


def utilization(res: RunResult, t0: float, t1: float, calls: Calls | None = None) -> float:
    ok, _ = (calls or Calls(res)).counts(t0, t1)
    return ok / res.scenario.capacity_between(t0, t1)


def refusal_pct(res: RunResult, t0: float, t1: float, calls: Calls | None = None) -> float:
    ok, ref = (calls or Calls(res)).counts(t0, t1)
    return 100.0 * ref / max(1, ok + ref)


def _pct(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    s = sorted(values)
    k = (len(s) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def _admitted_rates(res: RunResult, t0: float, t1: float, inst: int | None = None) -> list[float]:
    return [
        r.claimed / r.span
        for r in res.ticks
        if t0 <= r.t < t1 and (inst is None or r.instance == inst)
    ]


def _phase_bounds(sc: Scenario) -> list[tuple[float, float, float]]:
    ends = [start for start, _ in sc.phases[1:]] + [sc.duration]
    return [(start, end, c) for (start, c), end in zip(sc.phases, ends, strict=True)]


def _s1_like(res: RunResult) -> dict[str, float]:
    sc = res.scenario
    calls = Calls(res)
    phases = _phase_bounds(sc)
    out: dict[str, float] = {
        "util_steady_min": min(utilization(res, a + 60.0, b, calls) for a, b, _ in phases),
        "util_overall": utilization(res, 0.0, sc.duration, calls),
        "refused_pct": refusal_pct(res, 0.0, sc.duration, calls),
    }
    # oscillation: p95 - p5 of the per-tick admitted rate, steady part of each phase
    out["oscillation_pct"] = max(
        100.0 * (_pct(r, 0.95) - _pct(r, 0.05)) / c
        for a, b, c in phases
        if (r := _admitted_rates(res, a + 60.0, b))
    )
    # the drop (100 -> 30): overshoot ticks once refusals are visible, and recovery
    (t_drop, c_drop), (t_rise, c_rise) = sc.phases[1], sc.phases[2]
    # the first tick whose window can hold refusals of calls made after the drop
    after = [r for r in res.ticks if r.t > t_drop]
    visible = next((r.t for r in after if r.refused_seen > 0), math.inf)
    settled = next((r.t for r in after if r.t > visible and r.clean_fresh), math.inf)
    out["drop_overshoot_ticks"] = float(
        sum(1 for r in after if visible <= r.t < settled and r.claimed / r.span > c_drop)
    )
    out["drop_overshoot_ticks_10s"] = float(
        sum(1 for r in after if visible <= r.t < visible + 10.0 and r.claimed / r.span > c_drop)
    )
    rec = next(
        (r.t for r in after if r.t >= visible and r.claimed / r.span >= 0.9 * c_drop), math.inf
    )
    out["drop_recovery_s"] = rec - t_drop
    rise = next(
        (r.t for r in res.ticks if r.t >= t_rise and r.claimed / r.span >= 0.9 * c_rise),
        math.inf,
    )
    out["rise_recovery_s"] = rise - t_rise
    return out


def _s1(res: RunResult) -> dict[str, float]:
    return _s1_like(res)


def _overall(res: RunResult) -> dict[str, float]:
    calls = Calls(res)
    d = res.scenario.duration
    return {
        "util_overall": utilization(res, 0.0, d, calls),
        "refused_pct": refusal_pct(res, 0.0, d, calls),
    }


JAIN_WINDOW_S = 30.0


def _jain(xs: list[float]) -> float:
    s, q = sum(xs), sum(x * x for x in xs)
    return 1.0 if q == 0 else s * s / (len(xs) * q)


def _s2(res: RunResult) -> dict[str, float]:
    """Jain index of the two instances' accepted calls over sliding 30 s windows
    (5 s apart): the worst window starting 120 s or more after the second start,
    and how long after that start the index stays >= 0.99 for good."""
    sc = res.scenario
    start2 = sc.instances[1].start
    calls = [Calls(res, inst=i) for i in range(2)]
    starts, t = [], start2
    while t + JAIN_WINDOW_S <= sc.duration + 1e-9:
        starts.append(t)
        t += 5.0
    jain = [_jain([float(c.counts(t, t + JAIN_WINDOW_S)[0]) for c in calls]) for t in starts]
    worst = min((j for t, j in zip(starts, jain, strict=True) if t >= start2 + 120.0), default=1.0)
    fair_after = 0.0
    for t, j in zip(starts, jain, strict=True):
        if j < 0.99:
            fair_after = t + 5.0 - start2
    return {"jain_min": worst, "fair_after_s": fair_after, **_overall(res)}


def _s3(res: RunResult) -> dict[str, float]:
    windows = sorted(res.ra_windows)
    inside = 0
    for t in res.dispatch_t:
        k = bisect.bisect_right(windows, (t, math.inf))
        if any(a < t < b for a, b in windows[max(0, k - 64) : k]):
            inside += 1
    return {"dispatches_in_retry_after": float(inside), **_overall(res)}


def ideal_drain_seconds(sc: Scenario) -> float:
    """When the initial backlog would be gone at full capacity minus the live load."""
    left = float(sc.ledgers[0].backlog or 0)
    live = sc.ledgers[0].live_rate
    for a, b, c in _phase_bounds(sc):
        net = c - live
        if net * (b - a) >= left:
            return a + left / net
        left -= net * (b - a)
    return math.inf


def _s4(res: RunResult) -> dict[str, float]:
    sc = res.scenario
    live = Calls(res, live=True)
    ok, ref = live.counts(0.0, sc.duration)
    drained = res.drained_at if res.drained_at is not None else math.inf
    return {
        "live_p99_wait_s": _pct(res.live_waits, 0.99),
        "live_refused_pct": 100.0 * ref / max(1, ok + ref),
        "drain_vs_ideal": drained / ideal_drain_seconds(sc),
        **_overall(res),
    }


def _s5(res: RunResult) -> dict[str, float]:
    sc = res.scenario
    c = sc.phases[0][1]
    calls = Calls(res)
    t = 5.0
    while t <= sc.duration:
        ok, _ = calls.counts(t - 5.0, t)
        if ok >= 0.9 * c * 5.0:
            break
        t += 1.0
    return {"time_to_90pct_s": t, **_overall(res)}


def _s6(res: RunResult) -> dict[str, float]:
    sc = res.scenario
    calls = Calls(res)
    stop = sc.instances[0].stop or 0.0
    start = sc.instances[1].start
    before = _admitted_rates(res, stop - 10.0, stop, inst=0)
    after = _admitted_rates(res, start, start + 10.0, inst=1)
    return {
        "resume_rate_ratio": (sum(after) / len(after)) / (sum(before) / len(before)),
        "util_after_handover": utilization(res, start, start + 60.0, calls),
        "refused_pct_after_handover": refusal_pct(res, stop, stop + 30.0, calls),
        **_s1_like(res),
    }


METRICS: dict[str, Callable[[RunResult], dict[str, float]]] = {
    "S1": _s1,
    "S1-strict": _overall,
    "S2": _s2,
    "S3": _s3,
    "S4": _s4,
    "S5": _s5,
    "S6": _s6,
    "S7": _overall,
}


def measure(name: str, law: str, seed: int) -> dict[str, float]:
    """The metrics of one run of scenario ``name`` (pacerd's real admission,
    ``law`` as its law, ``seed``)."""
    return METRICS[name](run(SCENARIOS[name], law, seed))


@dataclass(frozen=True, slots=True)
class Target:
    metric: str
    op: str  # ">=" or "<="
    value: float

    def ok(self, x: float) -> bool:
        return x >= self.value if self.op == ">=" else x <= self.value

    def worst(self, xs: list[float]) -> float:
        return min(xs) if self.op == ">=" else max(xs)


TARGETS: dict[str, tuple[Target, ...]] = {
    "S1": (
        Target("util_steady_min", ">=", 0.93),
        Target("util_overall", ">=", 0.90),
        Target("refused_pct", "<=", 1.5),
        Target("drop_overshoot_ticks", "<=", 0.0),
        Target("drop_recovery_s", "<=", 10.0),
        Target("rise_recovery_s", "<=", 20.0),
        Target("oscillation_pct", "<=", 15.0),
    ),
    "S1-strict": (Target("util_overall", ">=", 0.90), Target("refused_pct", "<=", 2.0)),
    "S2": (Target("jain_min", ">=", 0.99),),
    "S3": (Target("dispatches_in_retry_after", "<=", 0.0), Target("util_overall", ">=", 0.85)),
    "S4": (
        Target("live_p99_wait_s", "<=", DEFAULT.tick_seconds + 1.0),
        Target("live_refused_pct", "<=", 0.5),
        Target("drain_vs_ideal", "<=", 1.10),
    ),
    "S5": (Target("time_to_90pct_s", "<=", 45.0),),
    "S6": (
        Target("resume_rate_ratio", ">=", 0.8),
        Target("resume_rate_ratio", "<=", 1.25),
        Target("util_after_handover", ">=", 0.90),
        Target("refused_pct_after_handover", "<=", 3.0),
        Target("util_overall", ">=", 0.90),
        Target("refused_pct", "<=", 1.5),
    ),
    "S7": (Target("util_overall", ">=", 0.90), Target("refused_pct", "<=", 2.0)),
}
