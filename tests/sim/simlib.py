"""A deterministic simulation of pacerd against a rate-limited upstream.

One discrete-event loop on a fake clock (no sleeping, no asyncio) drives:

- a model **upstream**: a token bucket refilled at a scripted capacity C(t)
  (piecewise constant, jobs/s) holding at most ``burst_seconds x C(t)``
  tokens; a call that finds no token is refused (429), optionally with a
  Retry-After. In *penalty* mode an overshoot closes the upstream for
  ``penalty_seconds``: every call is refused, advertising the time left;
- a **worker pool** per instance: a call reaches the upstream after a small
  broker delay (when a worker is free), holds the worker for a seeded
  lognormal latency (median 200 ms) and its outcome reaches the ledger after a
  seeded lognormal report delay;
- an in-memory **ledger** per destination: the due backlog ordered by
  ``next_attempt_at`` (a refused job goes back keeping its place, or no
  earlier than its Retry-After, which also closes the destination), live jobs
  arriving as a Poisson process, lanes as DESIGN.md defines them, the epoch
  stamped on each claimed job and compared when its outcome is reported, the
  outcome counters since the last tick, and the persisted pacer state;
- **admission**, driven exactly as ``pacerd.admission`` drives the pacer: one
  ``plan_tick`` per tick with the window, the previous tick's demand, the
  in-flight count and the remaining cool-down; the lane split; the claimed jobs
  published across the tick at ``pacer.publish_offsets`` (live first, at a
  pace under the ceiling, the rest evenly); a publish that finds the
  destination closed by a Retry-After reported since the claim is released
  instead; the next tick at the plan's deadline; the previous tick's demand.

The law is pluggable (``PacerdLaw``, ``HalvingLaw``), so the bench compares
pacerd's law with the plain halving AIMD under identical conditions.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from pacerd import pacer
from pacerd.pacer import Demand, OutcomeWindow, PacerState, PacingParams, TickPlan

if TYPE_CHECKING:
    from collections.abc import Callable

# ---------------------------------------------------------------------------
# laws


class Law(Protocol):
    name: str

    def initial(self, params: PacingParams, now: float) -> PacerState: ...

    def plan(
        self,
        state: PacerState,
        window: OutcomeWindow,
        demand: Demand | None,
        *,
        now: float,
        inflight: int,
        params: PacingParams,
        cooldown_remaining_s: float,
    ) -> tuple[PacerState, TickPlan]: ...


class PacerdLaw:
    """pacerd's own law, exactly as admission calls it."""

    name = "pacerd"

    def initial(self, params: PacingParams, now: float) -> PacerState:
        return pacer.initial_state(params, now=now)

    def plan(
        self,
        state: PacerState,
        window: OutcomeWindow,
        demand: Demand | None,
        *,
        now: float,
        inflight: int,
        params: PacingParams,
        cooldown_remaining_s: float,
    ) -> tuple[PacerState, TickPlan]:
        return pacer.plan_tick(
            state,
            window,
            demand,
            now=now,
            inflight=inflight,
            params=params,
            cooldown_remaining_s=cooldown_remaining_s,
        )


class HalvingLaw:
    """The baseline: halve on refusal, +1 job/s on a clean tick with demand.

    It shares pacerd's budget arithmetic, sub-tick spacing, lane split and
    Retry-After closure, so only the control law differs."""

    name = "halving"

    def initial(self, params: PacingParams, now: float) -> PacerState:
        return pacer.initial_state(params, now=now)

    def plan(
        self,
        state: PacerState,
        window: OutcomeWindow,
        demand: Demand | None,
        *,
        now: float,
        inflight: int,
        params: PacingParams,
        cooldown_remaining_s: float,
    ) -> tuple[PacerState, TickPlan]:
        rate = state.rate
        if window.refused > 0:
            rate = rate / 2.0
        elif (
            cooldown_remaining_s <= 0
            and demand is not None
            and demand.budget > 0
            and demand.admitted >= demand.budget
            and not demand.backlog_empty
        ):
            rate = rate + 1.0
        rate = min(params.max_rate, max(params.min_rate, rate))
        state = PacerState(
            rate=rate,
            credit=state.credit,
            last_tick=state.last_tick,
            deadline=state.deadline,
            epoch=state.epoch,
        )
        return pacer.tick_budget(
            state,
            now=now,
            inflight=inflight,
            params=params,
            cooldown_remaining_s=cooldown_remaining_s,
        )


LAWS: dict[str, Law] = {"pacerd": PacerdLaw(), "halving": HalvingLaw()}

# ---------------------------------------------------------------------------
# scenario description


@dataclass(frozen=True, slots=True, kw_only=True)
class InstanceSpec:
    """One pacerd instance (leader of one destination's pacer)."""

    start: float = 0.0
    stop: float | None = None  # leadership lost at this time (graceful stop)
    ledger: int = 0  # index of the destination ledger it drives
    clock_offset: float = 1000.0  # its monotonic clock = sim time + offset


@dataclass(frozen=True, slots=True, kw_only=True)
class LedgerSpec:
    backlog: int | None = None  # overdue backlog jobs at t=0 (None: never runs dry)
    live_rate: float = 0.0  # live jobs arriving per second (Poisson)


@dataclass(frozen=True, slots=True, kw_only=True)
class Scenario:
    name: str
    duration: float
    phases: tuple[tuple[float, float], ...]  # (start second, capacity jobs/s)
    burst_seconds: float = 1.0
    penalty_seconds: float | None = None
    params: PacingParams = field(default_factory=PacingParams)
    ledgers: tuple[LedgerSpec, ...] = (LedgerSpec(),)
    instances: tuple[InstanceSpec, ...] = (InstanceSpec(),)
    workers: int = 200
    latency_median: float = 0.2
    latency_sigma: float = 0.5
    report_delay_median: float = 0.1
    report_delay_sigma: float = 0.5
    broker_delay: float = 0.003

    def capacity_at(self, t: float) -> float:
        cap = self.phases[0][1]
        for start, c in self.phases:
            if t >= start:
                cap = c
        return cap

    def capacity_between(self, t0: float, t1: float) -> float:
        """Integral of C(t) over [t0, t1): the calls the upstream could accept."""
        total = 0.0
        bounds = [*self.phases[1:], (math.inf, 0.0)]
        for (start, c), (end, _) in zip(self.phases, bounds, strict=True):
            lo, hi = max(t0, start), min(t1, end)
            if hi > lo:
                total += c * (hi - lo)
        return total


# ---------------------------------------------------------------------------
# the model upstream


class Upstream:
    def __init__(self, sc: Scenario) -> None:
        self.phases = sc.phases
        self.burst = sc.burst_seconds
        self.penalty = sc.penalty_seconds
        self.t = 0.0
        self.phase = 0
        self.cap = sc.phases[0][1]
        self.tokens = self.cap * self.burst
        self.closed_until = -math.inf

    def _advance(self, t: float) -> None:
        while self.phase + 1 < len(self.phases) and self.phases[self.phase + 1][0] <= t:
            start = self.phases[self.phase + 1][0]
            self.tokens = min(self.cap * self.burst, self.tokens + self.cap * (start - self.t))
            self.t = start
            self.phase += 1
            self.cap = self.phases[self.phase][1]
            self.tokens = min(self.tokens, self.cap * self.burst)
        self.tokens = min(self.cap * self.burst, self.tokens + self.cap * (t - self.t))
        self.t = t

    def call(self, t: float) -> tuple[bool, float | None]:
        """(accepted, retry_after_s) for a call arriving at ``t``."""
        self._advance(t)
        if t < self.closed_until:
            return False, self.closed_until - t
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True, None
        if self.penalty is not None:
            self.closed_until = t + self.penalty
            return False, self.penalty
        return False, None


# ---------------------------------------------------------------------------
# the ledger model


class Job:
    __slots__ = (
        "attempt",
        "due",
        "epoch",
        "first_dispatch",
        "lane_live",
        "latency",
        "live",
        "orig",
    )

    def __init__(self, due: float, *, live: bool, orig: bool) -> None:
        self.due = due  # next_attempt_at
        self.live = live  # never offered (a live-lane candidate)
        self.orig = orig  # part of the initial backlog
        self.epoch = 0
        self.attempt = 0
        self.first_dispatch: float | None = None
        self.lane_live = False
        self.latency = 0.0


class SimLedger:
    def __init__(self, spec: LedgerSpec, params: PacingParams) -> None:
        self.spec = spec
        self.live_window = params.live_window_seconds
        self.seq = 0
        self.backlog: list[tuple[float, int, Job]] = []  # due, ordered by next_attempt_at
        self.future: list[tuple[float, int, Job]] = []  # not yet due (Retry-After)
        self.live: list[tuple[float, int, Job]] = []  # never offered, due recently
        self.virgin_left: float = math.inf if spec.backlog is None else spec.backlog
        self.virgin_i = 0
        self.inflight = 0
        self.epoch = 0
        self.cooldown_until = -math.inf
        self.persisted: dict[str, float | int | bool | None] | None = None
        self.orig_done = 0
        self.drained_at: float | None = None
        self._reset_window(0.0)

    def _reset_window(self, t: float) -> None:
        self.w_acc = self.w_ref = self.w_acc_f = self.w_ref_f = 0
        self.w_ra: float | None = None
        self.w_since = t

    def take_window(self, t: float) -> OutcomeWindow:
        w = OutcomeWindow(
            accepted=self.w_acc,
            refused=self.w_ref,
            accepted_fresh=self.w_acc_f,
            refused_fresh=self.w_ref_f,
            retry_after_s=self.w_ra,
            interval_seconds=t - self.w_since,
        )
        self._reset_window(t)
        return w

    def _push(self, heap: list[tuple[float, int, Job]], job: Job) -> None:
        self.seq += 1
        heapq.heappush(heap, (job.due, self.seq, job))

    def _virgin_due(self) -> float:
        return -100_000.0 + self.virgin_i * 1e-3

    def add_live(self, t: float) -> None:
        self._push(self.live, Job(t, live=True, orig=False))

    def due_counts(self, t: float) -> tuple[int, float]:
        while self.future and self.future[0][0] <= t:
            heapq.heappush(self.backlog, heapq.heappop(self.future))
        horizon = t - self.live_window
        while self.live and self.live[0][0] < horizon:
            heapq.heappush(self.backlog, heapq.heappop(self.live))
        return len(self.live), len(self.backlog) + self.virgin_left

    def claim(self, n_live: int, n_backlog: int, epoch: int) -> list[Job]:
        jobs: list[Job] = []
        for _ in range(n_live):
            job = heapq.heappop(self.live)[2]
            job.lane_live = True
            jobs.append(job)
        for _ in range(n_backlog):
            if self.virgin_left > 0 and (
                not self.backlog or self._virgin_due() < self.backlog[0][0]
            ):
                job = Job(self._virgin_due(), live=False, orig=True)
                self.virgin_i += 1
                self.virgin_left -= 1
            else:
                job = heapq.heappop(self.backlog)[2]
            job.lane_live = False
            jobs.append(job)
        for job in jobs:
            job.epoch = epoch
            job.attempt += 1
        self.inflight += len(jobs)
        return jobs

    def release(self, job: Job) -> None:
        """A claim whose publish did not happen goes back where it was."""
        self.inflight -= 1
        self._push(self.live if job.live else self.backlog, job)

    def report(self, job: Job, t: float, accepted: bool, retry_after: float | None) -> None:
        self.inflight -= 1
        fresh = job.epoch >= self.epoch
        if accepted:
            self.w_acc += 1
            self.w_acc_f += fresh
            if job.orig:
                self.orig_done += 1
                if self.orig_done == self.spec.backlog:
                    self.drained_at = t
            return
        self.w_ref += 1
        self.w_ref_f += fresh
        if retry_after is not None:
            self.w_ra = retry_after if self.w_ra is None else max(self.w_ra, retry_after)
            self.cooldown_until = max(self.cooldown_until, t + retry_after)
            if t + retry_after > job.due:
                job.due = t + retry_after
                self._push(self.future, job)
                return
        self._push(self.backlog, job)


# ---------------------------------------------------------------------------
# the instances (admission + worker pool)


@dataclass(slots=True)
class TickRecord:
    t: float
    instance: int
    budget: int
    rate: float
    claimed: int
    refused_seen: int
    span: float
    clean_fresh: bool  # its window had fresh outcomes and no fresh refusal


class Instance:
    def __init__(
        self, idx: int, spec: InstanceSpec, ledger: SimLedger, law: Law, sc: Scenario
    ) -> None:
        self.idx = idx
        self.spec = spec
        self.ledger = ledger
        self.law = law
        self.params = sc.params
        self.active = False
        self.state: PacerState | None = None
        self.demand: Demand | None = None
        self.pool = [0.0] * sc.workers  # when each worker is free


@dataclass(slots=True)
class RunResult:
    scenario: Scenario
    law: str
    seed: int
    # one row per upstream call: arrival time, instance, accepted, live lane
    call_t: list[float] = field(default_factory=list)
    call_inst: list[int] = field(default_factory=list)
    call_ok: list[bool] = field(default_factory=list)
    call_live: list[bool] = field(default_factory=list)
    ticks: list[TickRecord] = field(default_factory=list)
    dispatch_t: list[float] = field(default_factory=list)
    ra_windows: list[tuple[float, float]] = field(default_factory=list)
    live_waits: list[float] = field(default_factory=list)
    drained_at: float | None = None


TICK, PUB, ARR, REP, LIVE, START, STOP = range(7)


def run(sc: Scenario, law: Law | str, seed: int) -> RunResult:
    """Runs one scenario with one law and one seed; deterministic."""
    law = LAWS[law] if isinstance(law, str) else law
    rng = random.Random(f"{sc.name}/{seed}")
    gauss, uniform = rng.gauss, rng.random
    exp = math.exp
    lat_mu, lat_sig = math.log(sc.latency_median), sc.latency_sigma
    rep_mu, rep_sig = math.log(sc.report_delay_median), sc.report_delay_sigma
    broker = sc.broker_delay
    p = sc.params
    up = Upstream(sc)
    ledgers = [SimLedger(spec, p) for spec in sc.ledgers]
    insts = [
        Instance(i, spec, ledgers[spec.ledger], law, sc) for i, spec in enumerate(sc.instances)
    ]
    res = RunResult(scenario=sc, law=law.name, seed=seed)
    events: list[tuple[float, int, int, int, Any]] = []
    counter = itertools.count()
    heappush, heappop = heapq.heappush, heapq.heappop

    def push(t: float, kind: int, a: int, b: Any = None) -> None:
        heappush(events, (t, next(counter), kind, a, b))

    for i, led in enumerate(ledgers):
        if led.spec.live_rate > 0:
            push(rng.expovariate(led.spec.live_rate), LIVE, i)
    for inst in insts:
        push(inst.spec.start, START, inst.idx)
        if inst.spec.stop is not None:
            push(inst.spec.stop, STOP, inst.idx)
    call_t, call_inst, call_ok, call_live = res.call_t, res.call_inst, res.call_ok, res.call_live
    duration = sc.duration
    upcall = up.call

    while events:
        t, _, kind, a, b = heappop(events)
        if t > duration:
            break
        if kind == ARR:
            ok, ra = upcall(t)
            call_t.append(t)
            call_inst.append(a)
            call_ok.append(ok)
            call_live.append(b.lane_live)
            rep = t + b.latency + exp(rep_mu + rep_sig * gauss(0.0, 1.0))
            heappush(events, (rep, next(counter), REP, a, (b, ok, ra)))
        elif kind == REP:
            job, ok, ra = b
            insts[a].ledger.report(job, t, ok, ra)
            if ra is not None:
                res.ra_windows.append((t, t - job.latency + ra))  # visible .. advertised end
        elif kind == PUB:
            inst = insts[a]
            led = inst.ledger
            if not inst.active or led.cooldown_until > t:
                led.release(b)
                continue
            res.dispatch_t.append(t)
            if b.first_dispatch is None:
                b.first_dispatch = t
                if b.lane_live:
                    res.live_waits.append(t - b.due)
            b.live = False
            pool = inst.pool
            start = max(t + broker * (0.5 + uniform()), heappop(pool))
            b.latency = exp(lat_mu + lat_sig * gauss(0.0, 1.0))
            heappush(pool, start + b.latency)
            heappush(events, (start, next(counter), ARR, a, b))
        elif kind == TICK:
            inst = insts[a]
            if inst.active:
                _tick(inst, t, res, push)
        elif kind == LIVE:
            ledgers[a].add_live(t)
            push(t + rng.expovariate(ledgers[a].spec.live_rate), LIVE, a)
        elif kind == START:
            inst = insts[a]
            now = t + inst.spec.clock_offset
            persisted = inst.ledger.persisted
            if persisted is not None:
                inst.state = PacerState.from_dict(persisted, now=now, params=p)
            else:
                inst.state = law.initial(p, now)
            inst.active = True
            push(t, TICK, a)
        elif kind == STOP:
            insts[a].active = False
    for led in ledgers:
        if led.drained_at is not None:
            res.drained_at = led.drained_at
    return res


def _tick(
    inst: Instance, t: float, res: RunResult, push: Callable[[float, int, int, Any], None]
) -> None:
    """One admission pass, as ``pacerd.admission`` runs it."""
    led = inst.ledger
    p = inst.params
    now = t + inst.spec.clock_offset
    assert inst.state is not None
    window = led.take_window(t)
    state, plan = inst.law.plan(
        inst.state,
        window,
        inst.demand,
        now=now,
        inflight=led.inflight,
        params=p,
        cooldown_remaining_s=max(0.0, led.cooldown_until - t),
    )
    inst.state = state
    led.epoch = state.epoch
    led.persisted = state.to_dict()
    live_due, backlog_due = led.due_counts(t)
    split = pacer.split_lanes(plan.budget, live_due, int(min(backlog_due, 1e9)), p)
    jobs = led.claim(split.live, split.backlog, state.epoch)
    span = plan.next_deadline - now
    clean = window.refused_fresh == 0 and window.accepted_fresh > 0
    rec = TickRecord(t, inst.idx, plan.budget, state.rate, len(jobs), window.refused, span, clean)
    res.ticks.append(rec)
    offsets = pacer.publish_offsets(plan, split.live, len(jobs))
    for off, job in zip(offsets, jobs, strict=True):
        push(t + off, PUB, inst.idx, job)
    inst.demand = Demand(
        budget=plan.budget,
        admitted=len(jobs),
        backlog_empty=len(jobs) < plan.budget,
        inflight_capped=plan.inflight_capped,
    )
    push(plan.next_deadline - inst.spec.clock_offset, TICK, inst.idx, None)
